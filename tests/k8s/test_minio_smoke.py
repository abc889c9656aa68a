"""The session's MinIO server stores and returns real objects, multipart included."""

from __future__ import annotations

import hashlib
import io
import os
from typing import Any

import pytest

pytestmark = pytest.mark.k8s

MIB = 1024 * 1024


def test_put_get_list_delete_20_mib(minio_server: Any) -> None:
    mc = minio_server.client()
    data = os.urandom(20 * MIB)
    mc.put_object(minio_server.bucket, "smoke/blob.bin", io.BytesIO(data), len(data))

    listed = {o.object_name: o.size for o in mc.list_objects(minio_server.bucket, "smoke/")}
    assert listed == {"smoke/blob.bin": len(data)}

    resp = mc.get_object(minio_server.bucket, "smoke/blob.bin")
    try:
        assert hashlib.sha256(resp.read()).digest() == hashlib.sha256(data).digest()
    finally:
        resp.close()
        resp.release_conn()

    mc.remove_object(minio_server.bucket, "smoke/blob.bin")
    assert list(mc.list_objects(minio_server.bucket, "smoke/")) == []


def test_multipart_upload(minio_server: Any) -> None:
    mc = minio_server.client()
    data = os.urandom(20 * MIB)
    # Unknown length with a 5 MiB part size makes the client upload four parts.
    result = mc.put_object(
        minio_server.bucket, "smoke/multi.bin", io.BytesIO(data), -1, part_size=5 * MIB
    )
    assert result.etag.endswith("-4"), f"expected a 4-part upload, got etag {result.etag}"
    stat = mc.stat_object(minio_server.bucket, "smoke/multi.bin")
    assert stat.size == len(data)
    resp = mc.get_object(minio_server.bucket, "smoke/multi.bin", offset=7 * MIB, length=MIB)
    try:
        assert resp.read() == data[7 * MIB : 8 * MIB]
    finally:
        resp.close()
        resp.release_conn()
