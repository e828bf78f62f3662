"""The vllm replica against the vLLM 0.33 stand-in (loopback only): loading full weights and LoRA adapters,
confirming them, rolling back a failed reload, and the version each call records."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import pytest

from fulmen.producers.llm_gateway.backends.base import ReplicaUnavailableError, VersionRefusedError
from fulmen.producers.llm_gateway.backends.vllm import VllmBackend
from fulmen.producers.llm_gateway.protocol import parse_chat, parse_completion
from fulmen.producers.llm_gateway.settings import LlmSection
from fulmen.schemas import ModelVersion
from fulmen.testing.vllm_standin import BASE_MODEL, VllmStandIn

pytestmark = pytest.mark.scale


@pytest.fixture
def checkpoints(tmp_path: Path) -> Path:
    for name in ("base", "v1", "v2", "lora2", "lora3"):
        (tmp_path / name).mkdir()
    return tmp_path


@pytest.fixture
async def standin(checkpoints: Path) -> AsyncIterator[VllmStandIn]:
    server = VllmStandIn(root=str(checkpoints / "base"))
    await server.start()
    yield server
    await server.stop()


async def backend_for(url: str, **options: object) -> VllmBackend:
    backend = VllmBackend(LlmSection(backend="vllm", model=BASE_MODEL, upstream_url=url, model_version=0, **options))
    await backend.start()
    return backend


def hf(version: int, uri: Path | str, fmt: str = "hf") -> ModelVersion:
    return ModelVersion(model_name="fulmen", version=version, uri=str(uri), format=fmt)  # type: ignore[arg-type]


def ask(text: str) -> object:
    return parse_chat({"model": "fulmen", "messages": [{"role": "user", "content": text}]}, 1)


async def test_the_standin_refuses_what_vllm_does_not_serve() -> None:
    plain = VllmStandIn(dev_mode=False, runtime_lora=False)
    url = await plain.start()
    root = url.removesuffix("/v1")
    try:
        async with aiohttp.ClientSession() as http:
            async with http.get(f"{url}/chat/completions") as wrong_method:
                assert wrong_method.status == 405 and (await wrong_method.json()) == {"detail": "Method Not Allowed"}
            for method, path in [
                ("POST", "/pause"),
                ("POST", "/collective_rpc"),
                ("GET", "/weight_info"),
                ("POST", "/v1/load_lora_adapter"),
                ("POST", "/update_weights"),
                ("POST", "/v1/update_weights_from_disk"),
                ("POST", "/reload_weights"),
            ]:
                async with http.request(method, f"{root}{path}", json={}) as missing:
                    assert (missing.status, await missing.json()) == (404, {"detail": "Not Found"}), path
            async with http.post(f"{url}/chat/completions", json={"model": "nope", "messages": []}) as unknown:
                error = (await unknown.json())["error"]
                assert unknown.status == 404 and error["type"] == "NotFoundError" and error["code"] == 404
            async with http.get(f"{root}/health") as health:
                assert health.status == 200
    finally:
        await plain.stop()


async def test_full_weights_load_through_pause_reload_label_resume_and_are_confirmed(
    standin: VllmStandIn, checkpoints: Path
) -> None:
    backend = await backend_for(standin.url)
    try:
        assert backend.model_version == 0 and backend.weights_uri == str(checkpoints / "base")  # /v1/models root
        assert backend.swaps_in_place(hf(1, checkpoints / "v1"))
        standin.requests.clear()
        await backend.load_version(hf(1, checkpoints / "v1"))
        result = await backend.chat(ask("after"))  # type: ignore[arg-type]
    finally:
        await backend.close()
    admin = [(method, path) for method, path, _ in standin.requests if not path.startswith("/v1/chat")]
    assert admin == [
        ("GET", "/weight_info"),
        ("POST", "/pause?mode=wait&clear_cache=true"),
        ("POST", "/collective_rpc"),
        ("POST", "/update_weight_version"),
        ("POST", "/resume"),
        ("GET", "/weight_info"),
    ]
    rpc = next(body for _, path, body in standin.requests if path == "/collective_rpc")
    assert rpc == {"method": "reload_weights", "kwargs": {"weights_path": str(checkpoints / "v1")}}
    assert standin.label == "1" and standin.weights == str(checkpoints / "v1") and not standin.paused
    assert backend.model_version == 1 and result.model_version == 1
    assert result.choices[0].text == "after | weights 1"
    asked = standin.requests[-1][2]
    assert asked["return_token_ids"] and asked["return_weight_versions"] and asked["model"] == BASE_MODEL


async def test_a_failed_reload_goes_back_to_the_previous_weights_and_is_refused(
    standin: VllmStandIn, checkpoints: Path
) -> None:
    backend = await backend_for(standin.url)
    try:
        standin.fail_loads = 1
        with pytest.raises(VersionRefusedError, match="could not load"):
            await backend.load_version(hf(1, checkpoints / "v1"))
        result = await backend.chat(ask("still"))  # type: ignore[arg-type]
        with pytest.raises(VersionRefusedError, match="could not load"):
            await backend.load_version(hf(2, checkpoints / "missing"))
    finally:
        await backend.close()
    reloads = [body["kwargs"]["weights_path"] for _, path, body in standin.requests if path == "/collective_rpc"]
    base = str(checkpoints / "base")
    assert reloads == [str(checkpoints / "v1"), base, str(checkpoints / "missing"), base]
    assert standin.weights == base and standin.label == "default" and not standin.paused
    assert backend.model_version == 0 and result.model_version == 0
    assert result.choices[0].text == "still | weights default"


async def test_when_going_back_fails_too_the_server_stays_paused_and_the_replica_is_out(checkpoints: Path) -> None:
    server = VllmStandIn(root="/nowhere/base")  # the weights it started with cannot be read again
    url = await server.start()
    backend = await backend_for(url)
    try:
        server.fail_loads = 1
        with pytest.raises(ReplicaUnavailableError, match="stays paused"):
            await backend.load_version(hf(1, checkpoints / "v1"))
        assert server.paused and server.weights is None
        await backend.probe()
        assert backend.model_version is None  # unknown: the router will load the version it wants
        await backend.load_version(hf(1, checkpoints / "v1"))
        assert backend.model_version == 1 and not server.paused
    finally:
        await backend.close()
        await server.stop()


async def test_without_dev_mode_a_full_weight_version_is_refused_with_what_to_set() -> None:
    server = VllmStandIn(dev_mode=False)
    url = await server.start()
    backend = await backend_for(url)
    try:
        with pytest.raises(VersionRefusedError, match="VLLM_SERVER_DEV_MODE=1"):
            await backend.load_version(hf(1, "/ckpt/1"))
    finally:
        await backend.close()
        await server.stop()
    assert backend.model_version == 0


async def test_lora_versions_load_beside_the_base_and_the_previous_adapter_is_unloaded_when_unused(
    standin: VllmStandIn, checkpoints: Path
) -> None:
    backend = await backend_for(standin.url)
    try:
        assert not backend.swaps_in_place(hf(2, checkpoints / "lora2", "hf_lora_adapter"))
        await backend.load_version(hf(2, checkpoints / "lora2", "hf_lora_adapter"))
        assert standin.adapters == {"fulmen-v2": str(checkpoints / "lora2")}
        two = await backend.complete(parse_completion({"model": "fulmen", "prompt": "p"}, 1))
        await backend.load_version(hf(3, checkpoints / "lora3", "hf_lora_adapter"))
        three = await backend.chat(ask("q"))  # type: ignore[arg-type]
        for task in list(backend._tasks):
            await task
    finally:
        await backend.close()
    assert two.model_version == 2 and two.choices[0].text == "p | fulmen-v2"
    assert three.model_version == 3 and three.choices[0].text == "q | fulmen-v3"
    assert standin.adapters == {"fulmen-v3": str(checkpoints / "lora3")}  # v2 unloaded once nothing used it
    loads = [body for _, path, body in standin.requests if path == "/v1/load_lora_adapter"]
    assert loads == [
        {"lora_name": "fulmen-v2", "lora_path": str(checkpoints / "lora2")},
        {"lora_name": "fulmen-v3", "lora_path": str(checkpoints / "lora3")},
    ]


@pytest.mark.multiagent
async def test_each_agents_adapter_is_a_lora_model_its_calls_name(standin: VllmStandIn, checkpoints: Path) -> None:
    """Per-agent adapters: agent A's version N is the LoRA model ``fulmen-A-vN``; A's calls name it, any other call
    names the base model; A's next version replaces A's adapter and leaves B's."""
    import dataclasses

    def agents(version: int, agent: str) -> ModelVersion:
        return ModelVersion(
            model_name="fulmen",
            version=version,
            uri=str(checkpoints / "lora2"),
            format="hf_lora_adapter",
            adapter=agent,
        )

    backend = await backend_for(standin.url)
    try:
        await backend.load_version(agents(1, "write"))
        await backend.load_version(agents(1, "re.write"))
        calls = {
            agent: await backend.chat(dataclasses.replace(ask("q"), agent=agent))  # type: ignore[type-var]
            for agent in ("write", "re.write", "check")
        }
        await backend.load_version(agents(2, "write"))
        for task in list(backend._tasks):
            await task
        assert backend.adapter_version("write") == 2 and backend.adapter_version("re.write") == 1
    finally:
        await backend.close()
    assert calls["write"].choices[0].text == "q | fulmen-write-v1" and calls["write"].adapter == "write"
    assert calls["re.write"].choices[0].text == "q | fulmen-re.write-v1" and calls["re.write"].model_version == 1
    assert calls["check"].choices[0].text == "q | weights default" and calls["check"].adapter is None  # the base
    assert set(standin.adapters) == {"fulmen-write-v2", "fulmen-re.write-v1"}  # write's v1 unloaded


async def test_without_runtime_lora_an_adapter_version_is_refused_with_what_to_set(checkpoints: Path) -> None:
    server = VllmStandIn(runtime_lora=False)
    url = await server.start()
    backend = await backend_for(url)
    try:
        with pytest.raises(VersionRefusedError, match="VLLM_ALLOW_RUNTIME_LORA_UPDATING=True"):
            await backend.load_version(hf(2, checkpoints / "lora2", "hf_lora_adapter"))
    finally:
        await backend.close()
        await server.stop()


async def test_the_version_a_call_records_is_the_one_vllm_says_sampled_it(standin: VllmStandIn) -> None:
    backend = await backend_for(standin.url)
    try:
        standin.label = "7"  # another client relabelled the weights behind this gateway's back
        relabelled = await backend.chat(ask("x"))  # type: ignore[arg-type]
        await standin.kill()
        await standin.start()  # restarted: its start-up weights, labelled "default"
        await backend.probe()
        restarted = backend.model_version
        after = await backend.chat(ask("y"))  # type: ignore[arg-type]
    finally:
        await backend.close()
    assert relabelled.model_version == 7
    assert restarted == 0 and after.model_version == 0  # "default": the version the server started with
