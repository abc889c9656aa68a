"""`relaytrain run --local` against S3 (a real MinIO): model, data, checkpoints and output.

Each stage downloads only the shards that hold its layers; checkpoints, progress.json
and the adapter go to the bucket. The links use the `delta` compression.
"""

from __future__ import annotations

import io
import json
import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from relaytrain_testkit.jobs import Job
from relaytrain_testkit.tiny_models import CORPUS, tiny_model_dir

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[2]


def test_a_job_on_s3_trains_from_and_writes_to_the_bucket(
    tmp_path: Path, minio_server: Any
) -> None:
    client = minio_server.client()
    bucket = minio_server.bucket
    model = tiny_model_dir(tmp_path / "model", layers=4, max_shard_size="40KB")
    for path in model.iterdir():
        client.fput_object(bucket, f"models/tiny/{path.name}", str(path))
    records = "".join(
        json.dumps({"text": f"{CORPUS[i % 5]} number {i}"}) + "\n" for i in range(32)
    ).encode()
    client.put_object(bucket, "data/train.jsonl", io.BytesIO(records), len(records))
    job = (
        Job("s3job", "team")
        .model(f"s3://{bucket}/models/tiny/", dtype="float32")
        .dataset(f"s3://{bucket}/data/train.jsonl", format="text", sequence_length=16,
                 packing=True)
        .validation(fraction=0.25)
        .method("lora", rank=4, alpha=8, target_modules=["q_proj"])
        .training(steps=4, micro_batch_size=2, micro_batches=2, learning_rate=0.01,
                  eval_every_steps=2)
        .pipeline(stages=2, compression="delta")  # rows' keys cross real stage processes
        .set("spec.pipeline.activationBasis", "fitted")  # and a basis fitted to the rows
        .checkpoint(f"s3://{bucket}/ckpt", endpoint=minio_server.url, every_steps=2, keep=1)
        .write(tmp_path / "job.yaml")
    )  # fmt: skip
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(REPO / "operator"), str(REPO / "worker_image")]),
        "AWS_ACCESS_KEY_ID": minio_server.access_key,
        "AWS_SECRET_ACCESS_KEY": minio_server.secret_key,
        "RELAYTRAIN_CACHE": str(tmp_path / "cache"),
    }
    done = subprocess.run(
        [sys.executable, "-m", "relaytrain_operator.cli", "run", str(job), "--local",
         "--workdir", str(tmp_path / "wd"), "--no-progress"],
        env=env, capture_output=True, text=True, timeout=600, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    # The store's keys went to the stages by their environment only: not into the run's
    # output, its logs, its state directory or the stage documents it wrote.
    written = [p for p in (tmp_path / "wd").rglob("*") if p.is_file()]
    assert any(p.name.endswith(".log") for p in written) and len(written) > 3, written
    for text, where in [(done.stdout + done.stderr, "the output")] + [
        (p.read_bytes().decode(errors="replace"), str(p)) for p in written
    ]:
        assert minio_server.secret_key not in text, f"the secret key is in {where}"
        assert minio_server.access_key not in text, f"the access key is in {where}"
    names = {o.object_name for o in client.list_objects(bucket, "ckpt/", recursive=True)}
    prefix = "ckpt/team/s3job/"
    assert f"{prefix}output/adapter_model.safetensors" in names
    assert f"{prefix}output/adapter_config.json" in names
    assert f"{prefix}step-4/manifest.json" in names and f"{prefix}step-2/manifest.json" not in names
    progress = json.loads(client.get_object(bucket, f"{prefix}progress.json").read())
    assert progress["done"] and progress["step"] == 4 and progress["lastCommittedStep"] == 4
    # Held-out rows crossed the delta links too, keyed apart from the training rows.
    assert progress["evalStep"] == 4 and math.isfinite(progress["evalLoss"]), progress
    # After 4 frames of full codes the first stage fitted a basis to them and sent it; the
    # second installed it, and the rows were coded in it (from that frame on at this width:
    # transform.switch_frames), which the second decoded (and trained on to the end).
    logs = "".join(p.read_text(errors="replace") for p in written if p.name.endswith(".log"))
    assert "sending basis 1 of the full codes (32 values a token" in logs, logs[-3000:]
    assert "installed basis 1 of the full codes (32 values a token)" in logs, logs[-3000:]
    assert "coding the full codes in basis 1 from this" in logs, logs[-3000:]
    # Both stages fetched into one cache directory for this model URI (which shards each
    # one fetches is tested in tests/unit/test_worker_loading.py).
    index = json.loads((model / "model.safetensors.index.json").read_text())["weight_map"]
    (cached,) = (tmp_path / "cache" / "s3-models").iterdir()
    assert {p.name for p in cached.glob("*.safetensors")} == set(index.values())
