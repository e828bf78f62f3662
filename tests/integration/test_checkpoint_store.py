"""Checkpoints in an object store, against a real S3 server (SeaweedFS's ``weed``, built once from its Go module:
:mod:`fulmen.testing.seaweedfs`).

- a directory goes up file by file with its manifest last and comes back whole and checked; a prefix without a
  manifest (an upload cut short) is no checkpoint, and a file replaced after its manifest was written is refused,
  leaving nothing in the cache; a deleted checkpoint is gone from the listing;
- the model a torchrun job of several machines starts from goes to the store once (without optimizer state),
  at ``<run>/base`` or at a version's published place;
- a gateway's model cache (:func:`fulmen.producers.llm_gateway.model_cache.local_version`) fetches a version
  published with an ``s3://`` URI once and hands the backend a local directory;
- ``fulmen train`` with ``FULMEN_TRAIN_CHECKPOINT_URI`` publishes each version at its ``s3://`` URI (model and
  optimizer state apart, the older states removed), and the same command on a machine without the run directory
  (removed here) resumes from the latest version in the store, with no step lost or doubled.
"""

from __future__ import annotations

import asyncio
import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

from fulmen.algorithm.service.checkpoints import model_in_store
from fulmen.infra.objectstore import (
    MANIFEST,
    CheckpointUnavailableError,
    delete_checkpoint,
    download_dir,
    list_checkpoints,
    read_manifest,
    upload_dir,
)
from fulmen.infra.settings import FulmenSettings
from fulmen.producers.llm_gateway.model_cache import local_version
from fulmen.schemas import ModelVersion, TopicKey, TrainStep
from fulmen.testing.seaweedfs import SeaweedS3, build_weed, cached_weed
from tests.integration.test_train_loop import fulmen_train, read_topic, simulated_runners

pytestmark = [pytest.mark.integration, pytest.mark.cluster]


@pytest.fixture(scope="module")
def s3(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SeaweedS3]:
    if shutil.which("go") is None and not cached_weed().is_file():
        pytest.skip("SeaweedFS (the S3 server these tests use) is built with Go, which this machine lacks")
    with SeaweedS3(tmp_path_factory.mktemp("seaweedfs"), weed=build_weed()) as server:
        saved = {k: os.environ.get(k) for k in server.environment()}
        os.environ.update(server.environment())
        try:
            yield server
        finally:
            for key, value in saved.items():
                if value is None:
                    os.environ.pop(key, None)
                else:
                    os.environ[key] = value


def a_checkpoint(path: Path) -> Path:
    (path / "sub").mkdir(parents=True)
    (path / "config.json").write_text('{"model_type": "llama"}')
    (path / "model.safetensors").write_bytes(os.urandom(3 * 1024 * 1024 + 17))  # several chunks
    (path / "sub" / "adapter.json").write_text("{}")
    return path


def test_a_directory_round_trips_and_only_a_whole_checked_one_is_served(s3: SeaweedS3, tmp_path: Path) -> None:
    local = a_checkpoint(tmp_path / "v1")
    uri = f"s3://{s3.bucket}/round/v1"
    assert upload_dir(local, uri) == uri
    fetched = download_dir(uri, tmp_path / "cache")
    for name in ("config.json", "model.safetensors", "sub/adapter.json"):
        assert (fetched / name).read_bytes() == (local / name).read_bytes()
    assert download_dir(uri, tmp_path / "cache") == fetched  # cached: fetched once
    assert set(read_manifest(uri)["files"]) == {"config.json", "model.safetensors", "sub/adapter.json"}

    # an upload cut short: its files are there, its manifest is not
    upload_dir(a_checkpoint(tmp_path / "v2"), f"s3://{s3.bucket}/round/v2", only=lambda relative: False)
    import obstore
    from obstore.store import S3Store

    store = S3Store.from_url(f"s3://{s3.bucket}")
    obstore.put(store, "round/v3/config.json", b"{}")
    with pytest.raises(CheckpointUnavailableError, match="no fulmen-manifest.json"):
        download_dir(f"s3://{s3.bucket}/round/v3", tmp_path / "cache")
    assert list_checkpoints(f"s3://{s3.bucket}/round") == {1: uri, 2: f"s3://{s3.bucket}/round/v2"}

    # a file replaced after the manifest was written is refused, and nothing lands in the cache
    obstore.put(store, "round/v1/config.json", b'{"model_type": "other"}')
    with pytest.raises(CheckpointUnavailableError, match="does not match"):
        download_dir(uri, tmp_path / "other-cache")
    assert not list((tmp_path / "other-cache").iterdir())

    delete_checkpoint(uri)
    assert read_manifest(uri) is None and list_checkpoints(f"s3://{s3.bucket}/round") == {
        2: f"s3://{s3.bucket}/round/v2"
    }


def test_the_gateway_fetches_a_version_published_in_the_store_once(s3: SeaweedS3, tmp_path: Path) -> None:
    uri = upload_dir(a_checkpoint(tmp_path / "v4"), f"s3://{s3.bucket}/served/v4")
    event = ModelVersion(model_name="fulmen", version=4, uri=uri, format="hf", run_id="r", step=4)
    local, took = local_version(event, tmp_path / "model-cache")
    assert Path(local.uri).parent == tmp_path / "model-cache" and (Path(local.uri) / "config.json").is_file()
    assert took > 0 and (local.version, local.run_id) == (4, "r")
    again, took = local_version(event, tmp_path / "model-cache")
    assert again.uri == local.uri and took < 1  # the cached copy
    on_disk = ModelVersion(model_name="fulmen", version=5, uri=str(tmp_path / "v4"), format="hf", run_id="r", step=5)
    assert local_version(on_disk, tmp_path / "model-cache") == (on_disk, 0.0)


def test_the_model_a_torchrun_job_starts_from_is_put_in_the_store_once_for_ranks_on_other_machines(
    s3: SeaweedS3, tmp_path: Path
) -> None:
    prefix = f"s3://{s3.bucket}/jobs"
    base = a_checkpoint(tmp_path / "base-model")
    (base / "training_state.pt").write_bytes(b"not a model file")
    assert model_in_store(base, "job", prefix) == f"{prefix}/job/base"
    first = read_manifest(f"{prefix}/job/base")
    assert "training_state.pt" not in first["files"]
    (base / "config.json").write_text('{"changed": true}')
    assert model_in_store(base, "job", prefix) == f"{prefix}/job/base"
    assert read_manifest(f"{prefix}/job/base") == first  # already there: not uploaded again
    version = a_checkpoint(tmp_path / "run" / "checkpoints" / "v7")
    assert model_in_store(version, "job", prefix) == f"{prefix}/job/v7"  # where a version is published


async def test_fulmen_train_publishes_to_the_store_and_resumes_from_it_without_its_run_dir(
    s3: SeaweedS3, settings: FulmenSettings, tmp_path: Path
) -> None:
    dataset = tmp_path / "train.jsonl"
    dataset.write_text('{"question": "1 + 1"}\n{"question": "2 + 2"}\n')
    prefix = f"s3://{s3.bucket}/runs"
    env = {k: v for k, v in os.environ.items() if not k.startswith("FULMEN_")} | {
        "FULMEN_KAFKA_BOOTSTRAP": settings.bootstrap,
        "FULMEN_KAFKA_TOPIC_PREFIX": settings.kafka.topic_prefix,
        "FULMEN_HOME": str(tmp_path / "home"),
        "FULMEN_TRAIN_GROUP_SIZE": "2",
        "FULMEN_TRAIN_GROUPS_PER_STEP": "1",
        "FULMEN_TRAIN_DEVICE": "cpu",
        "FULMEN_TRAIN_CHECKPOINT_URI": prefix,
    }
    args = ["--dataset", str(dataset), "--model", "tiny", "--agent", "agents:solve", "--run", "stored"]
    stop = asyncio.Event()
    runners = asyncio.create_task(simulated_runners(settings, stop))
    try:
        first = await fulmen_train(env, *args, "--steps", "2")
        shutil.rmtree(tmp_path / "home")  # another machine: no run directory, no checkpoints on its disk
        again = await fulmen_train(env, *args, "--steps", "3")
    finally:
        stop.set()
        await asyncio.wait_for(runners, 60)
    assert first[0] == 0, first[2]
    assert again[0] == 0, again[2]
    versions = await read_topic(settings, TopicKey.MODELS, ModelVersion)
    assert [(v.version, v.uri) for v in versions] == [(n, f"{prefix}/stored/v{n}") for n in (1, 2, 3)]
    steps = [s.step for s in await read_topic(settings, TopicKey.METRICS, TrainStep)]
    assert sorted(steps) == [1, 2, 3]  # step 3 only was trained by the second command
    assert set(list_checkpoints(f"{prefix}/stored")) == {1, 2, 3}
    assert set(list_checkpoints(f"{prefix}/stored/state")) == {3}  # the latest optimizer state only
    manifest = read_manifest(f"{prefix}/stored/v3")
    assert "config.json" in manifest["files"] and "training_state.pt" not in manifest["files"]
    assert MANIFEST not in manifest["files"]
    restored = tmp_path / "home" / "runs" / "stored" / "checkpoints"
    assert sorted(p.name for p in restored.iterdir() if p.is_dir()) == ["v2", "v3"]
