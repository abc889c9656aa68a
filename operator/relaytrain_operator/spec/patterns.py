"""Patterns for URIs and names, shared verbatim by the pydantic models and the CRD.

RE2 (the API server) and Python's `re` agree on this subset; tests/unit/test_crd_schema.py
checks the CRD carries exactly these strings. HINTS turns a pattern mismatch into words.
"""

from __future__ import annotations

# s3://bucket[/prefix] with S3's bucket naming rules (3-63 chars: lowercase, digits, . -).
_S3 = r"s3://[a-z0-9][a-z0-9.-]{1,61}[a-z0-9](/[^\s]*)?"
_HF = r"hf://[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*"
# A local path has no scheme: no colon at all keeps http://, gs:// and C:\ out.
_LOCAL = r"file:///?[^\s:]+|[^\s:][^:]*"

MODEL_URI = rf"^({_S3}|{_HF}|{_LOCAL})$"
STORE_URI = rf"^({_S3}|{_LOCAL})$"
ENDPOINT = r"^https?://[^\s/]+(/[^\s]*)?$"
# The job's name names a Service and prefixes pod hostnames (`<job>-stage-<k>`), so it must
# be a DNS-1035 label with room for that suffix within 63 characters.
JOB_NAME = r"^[a-z]([-a-z0-9]*[a-z0-9])?$"
JOB_NAME_MAX = 50

HINTS: dict[str, str] = {
    MODEL_URI: "should be s3://bucket/prefix (bucket: 3-63 of a-z 0-9 . -), hf://org/name, "
    "or a local path",
    STORE_URI: "should be s3://bucket/prefix (bucket: 3-63 of a-z 0-9 . -) or a local path",
    ENDPOINT: "should be an http:// or https:// URL such as http://minio.minio:9000",
    JOB_NAME: "should be a DNS-1035 label: lowercase letters, digits and '-', starting with "
    "a letter",
}
