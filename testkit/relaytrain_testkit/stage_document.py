"""A stage document as the operator writes it (docs/stage-contract.md's example): every
section filled, for tests of how the worker reads it."""

from __future__ import annotations

from typing import Any

DOC: dict[str, Any] = {
    "apiVersion": "relaytrain.io/v1alpha1",
    "kind": "StageConfig",
    "job": {"namespace": "default", "name": "smollm-lora", "uid": "u1"},
    "stage": {"index": 1, "count": 3, "layerStart": 10, "layerEnd": 20},
    "model": {"uri": "s3://models/smollm2-135m/", "dtype": "float32"},
    "dataset": {"uri": "s3://data/train.jsonl", "format": "prompt-completion",
                "textField": "text", "promptField": "prompt", "completionField": "completion",
                "messagesField": "messages", "sequenceLength": 256, "packing": False,
                "truncation": "truncate"},
    "method": {"type": "lora", "rank": 8, "alpha": 16, "dropout": 0.0,
               "targetModules": ["q_proj", "k_proj", "v_proj", "o_proj"]},
    "training": {"steps": 100, "microBatchSize": 4, "microBatches": 8, "learningRate": 0.0002,
                 "schedule": "cosine", "warmupSteps": 10, "weightDecay": 0.0,
                 "maxGradNorm": 1.0, "seed": 42},
    "pipeline": {
        "schedule": "1f1b", "compression": "int8", "forwardsAhead": 0, "gradientTokens": 1.0,
        "gradientBits": 2, "gradientFill": "none", "activationError": "int4",
        "activationBasis": "identity",
    },
    "links": {"listen": "0.0.0.0:29500", "next": "job-stage-2.job.default.svc:29500",
              "identity": "relaytrain://default/smollm-lora/p0/s1",
              "prevIdentity": "relaytrain://default/smollm-lora/p0/s0",
              "nextIdentity": "relaytrain://default/smollm-lora/p0/s2",
              "credentialsDir": "/var/run/relaytrain/link", "renewalGraceSeconds": 180},
    "checkpoint": {"uri": "s3://relaytrain/checkpoints", "endpoint": "http://minio:9000",
                   "accessKeyEnv": "AWS_ACCESS_KEY_ID", "secretKeyEnv": "AWS_SECRET_ACCESS_KEY",
                   "everySteps": 20, "keep": 2},
    "output": {"uri": "s3://relaytrain/adapters/smollm-lora/"},
    "observability": {"port": 9400},
}  # fmt: skip
