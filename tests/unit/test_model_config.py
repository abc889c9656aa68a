"""Where `relaytrain plan` finds the model's architecture: flag, URI, hub cache, shipped."""

from __future__ import annotations

import json
import socket
import threading
from functools import partial
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from relaytrain_operator import cli
from relaytrain_operator.domain.planner import ModelShape
from relaytrain_operator.store import model_config
from relaytrain_operator.store.model_config import (
    ModelConfigError,
    hub_cache_dir,
    named_model,
    resolve,
    shipped_config,
    shipped_names,
)
from relaytrain_testkit.harness.ports import free_port  # a port nothing listens on
from relaytrain_testkit.jobs import Job
from relaytrain_testkit.shapes import SMOLLM2_135M_CONFIG

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]
NO_ENV: dict[str, str] = {}


def tiny(layers: int) -> dict[str, object]:
    return {**SMOLLM2_135M_CONFIG, "num_hidden_layers": layers}


def write_config(folder: Path, layers: int) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "config.json"
    path.write_text(json.dumps(tiny(layers)))
    return path


def test_model_config_flag_wins_over_a_readable_uri(tmp_path):
    given = write_config(tmp_path / "given", 7)
    write_config(tmp_path / "llama-3.1-8b", 3)
    found = resolve(str(tmp_path / "llama-3.1-8b"), model_config=given, environ=NO_ENV)
    assert found.config["num_hidden_layers"] == 7
    assert found.source == "model-config" and found.location == str(given)
    assert found.describe() == f"{given} (--model-config)"


def test_an_unreadable_model_config_flag_is_an_error_not_a_fallback(tmp_path):
    with pytest.raises(ModelConfigError, match="cannot read --model-config"):
        resolve("s3://models/llama-3.1-8b/", model_config=tmp_path / "nope.json", environ=NO_ENV)


@pytest.mark.parametrize("form", ["dir", "dir/", "file://dir", "dir/config.json"])
def test_a_local_model_uri_is_read(tmp_path, form):
    write_config(tmp_path / "dir", 5)
    uri = form.replace("dir", str(tmp_path / "dir"), 1)
    found = resolve(uri, environ=NO_ENV)
    assert found.config["num_hidden_layers"] == 5
    assert found.source == "uri" and found.location == str(tmp_path / "dir" / "config.json")
    assert found.skipped == ()


def test_a_found_config_that_is_not_json_is_an_error_even_with_a_shipped_name(tmp_path):
    folder = tmp_path / "llama-3.1-8b"
    folder.mkdir()
    (folder / "config.json").write_text("{not json")
    with pytest.raises(ModelConfigError, match="is not JSON"):
        resolve(str(folder), environ=NO_ENV)


def _hub_snapshot(cache: Path, repo: str, rev: str, layers: int, *, ref: bool = True) -> Path:
    """The huggingface_hub cache layout: blobs, snapshots/<rev>/ symlinks, refs/main."""
    folder = cache / ("models--" + repo.replace("/", "--"))
    blob = folder / "blobs" / f"blob-{rev}"
    blob.parent.mkdir(parents=True, exist_ok=True)
    blob.write_text(json.dumps(tiny(layers)))
    snapshot = folder / "snapshots" / rev
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").symlink_to(blob)
    if ref:
        (folder / "refs").mkdir(exist_ok=True)
        (folder / "refs" / "main").write_text(rev)
    return snapshot / "config.json"


def test_hf_uri_reads_the_hub_cache_snapshot_refs_main_names(tmp_path):
    cache = tmp_path / "hub"
    _hub_snapshot(cache, "acme/tiny-llama", "a" * 40, 3, ref=False)
    newest = _hub_snapshot(cache, "acme/tiny-llama", "b" * 40, 6)
    found = resolve("hf://acme/tiny-llama", environ={"HF_HUB_CACHE": str(cache)})
    assert found.config["num_hidden_layers"] == 6
    assert found.source == "hf-cache" and found.location == str(newest)
    assert "huggingface_hub cache for hf://acme/tiny-llama" in found.describe()


def test_a_lone_snapshot_serves_without_refs_main(tmp_path):
    cache = tmp_path / "home" / "hub"
    _hub_snapshot(cache, "acme/tiny-llama", "c" * 40, 4, ref=False)
    found = resolve("hf://acme/tiny-llama", environ={"HF_HOME": str(tmp_path / "home")})
    assert found.config["num_hidden_layers"] == 4


def test_hub_cache_folder_is_found_like_huggingface_hub_finds_it(tmp_path):
    home = Path("~").expanduser()
    assert hub_cache_dir({}) == home / ".cache" / "huggingface" / "hub"
    assert hub_cache_dir({"XDG_CACHE_HOME": "/x"}) == Path("/x/huggingface/hub")
    assert hub_cache_dir({"XDG_CACHE_HOME": "/x", "HF_HOME": "/h"}) == Path("/h/hub")
    env = {"HF_HOME": "/h", "HUGGINGFACE_HUB_CACHE": "/old", "HF_HUB_CACHE": "/new"}
    assert hub_cache_dir(env) == Path("/new")
    del env["HF_HUB_CACHE"]
    assert hub_cache_dir(env) == Path("/old")


def test_hf_uri_not_in_the_cache_falls_back_to_a_shipped_config(tmp_path):
    found = resolve("hf://meta-llama/Llama-3.1-8B", environ={"HF_HUB_CACHE": str(tmp_path)})
    assert found.source == "shipped" and found.location == "llama-3.1-8b"
    assert found.config["num_hidden_layers"] == 32
    assert found.skipped == (
        f"huggingface_hub cache {str(tmp_path)!r}: no models--meta-llama--Llama-3.1-8B",
    )


@pytest.mark.parametrize(
    ("uri", "name"),
    [
        ("s3://models/llama-3.1-8b/", "llama-3.1-8b"),
        ("s3://relaytrain/models/smollm2-135m-instruct", "smollm2-135m-instruct"),
        ("hf://Qwen/Qwen2-0.5B", "qwen2-0.5b"),
        ("/data/Llama-3.1-8B/config.json", "llama-3.1-8b"),
        ("file:///data/SmolLM2-135M-Instruct/", "smollm2-135m-instruct"),
    ],
)
def test_the_uris_last_path_component_names_the_model(uri, name):
    assert named_model(uri) == name


@pytest.mark.timeout(60)  # a refused connection is an answer: no retries until a deadline
def test_an_unreachable_s3_endpoint_falls_back_to_the_shipped_config_quickly():
    endpoint = f"http://127.0.0.1:{free_port()}"
    found = resolve("s3://models/llama-3.1-8b/", endpoint=endpoint, environ=NO_ENV)
    assert found.source == "shipped"
    assert found.describe() == "llama-3.1-8b (shipped config for s3://models/llama-3.1-8b/)"
    (why,) = found.skipped
    assert why.startswith(f"s3://models/llama-3.1-8b/config.json at {endpoint}: ")
    assert "Connection refused" in why


def test_an_endpoint_that_is_not_s3_falls_back_with_the_reason(tmp_path):
    """A plain web server (the standard library's, serving an empty folder) answers 404 in
    HTML: not S3, so the shipped config serves and the reason says so."""
    handler = partial(SimpleHTTPRequestHandler, directory=str(tmp_path))
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    endpoint = f"http://127.0.0.1:{server.server_port}"
    try:
        found = resolve("s3://models/qwen2-0.5b/", endpoint=endpoint, environ=NO_ENV)
    finally:
        server.shutdown()
        server.server_close()
    assert found.source == "shipped"
    (why,) = found.skipped
    assert why.startswith(f"s3://models/qwen2-0.5b/config.json at {endpoint}: ")
    assert "non-XML response from server" in why


def test_s3_endpoint_comes_from_the_environment_when_the_job_names_none():
    endpoint = f"http://127.0.0.1:{free_port()}"
    found = resolve("s3://models/qwen2-0.5b", environ={"AWS_ENDPOINT_URL": endpoint})
    assert found.skipped[0].startswith(f"s3://models/qwen2-0.5b/config.json at {endpoint}: ")


@pytest.mark.timeout(60)  # a hang fails here
def test_an_s3_endpoint_that_never_answers_is_given_up_on(monkeypatch):
    """A server that accepts the connection and says nothing: the deadline, not a hang."""
    monkeypatch.setattr(model_config, "S3_DEADLINE_SECONDS", 0.5)
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen()
        endpoint = f"http://127.0.0.1:{silent.getsockname()[1]}"
        found = resolve("s3://models/smollm2-135m-instruct/", endpoint=endpoint, environ=NO_ENV)
    assert found.source == "shipped"
    assert found.skipped[0].endswith("no answer in 0.5 s")


def test_nothing_reachable_names_each_source_why_and_what_to_do():
    endpoint = f"http://127.0.0.1:{free_port()}"
    with pytest.raises(ModelConfigError) as err:
        resolve("s3://models/my-model/", endpoint=endpoint, environ=NO_ENV)
    message = str(err.value)
    assert "spec.model.uri 's3://models/my-model/'" in message
    assert f"s3://models/my-model/config.json at {endpoint}: " in message
    assert "Connection refused" in message
    assert "none is named 'my-model'" in message
    assert "--model-config" in message and "$AWS_ENDPOINT_URL" in message
    assert "llama-3.1-8b, qwen2-0.5b, smollm2-135m-instruct" in message


def test_a_missing_local_path_is_named(tmp_path):
    with pytest.raises(ModelConfigError, match="does not exist"):
        resolve(str(tmp_path / "my-model"), environ=NO_ENV)


@pytest.mark.parametrize(
    ("name", "layers", "hidden", "params"),
    [
        ("llama-3.1-8b", 32, 4096, 8_030_261_248),
        ("qwen2-0.5b", 24, 896, 494_032_768),
        ("smollm2-135m-instruct", 30, 576, 134_515_008),
    ],
)
def test_shipped_configs_are_the_public_models(name, layers, hidden, params):
    assert name in shipped_names()
    shape = ModelShape.from_hf_config(shipped_config(name))
    assert (shape.num_layers, shape.hidden_size, shape.total_params) == (layers, hidden, params)


def test_llama_3_1_8b_is_shipped_with_its_published_fields():
    config = shipped_config("llama-3.1-8b")
    assert {k: config[k] for k in (
        "num_attention_heads", "num_key_value_heads", "intermediate_size", "vocab_size",
        "rope_theta", "max_position_embeddings", "tie_word_embeddings", "torch_dtype",
    )} == {
        "num_attention_heads": 32, "num_key_value_heads": 8, "intermediate_size": 14336,
        "vocab_size": 128256, "rope_theta": 500000.0, "max_position_embeddings": 131072,
        "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    }  # fmt: skip


def test_every_example_names_a_shipped_model():
    import yaml

    jobs = [
        *(ROOT / "examples").glob("finetunejob-*.yaml"),
        ROOT / "examples/demo/finetunejob-demo.yaml",
    ]
    for job in jobs:
        uri = yaml.safe_load(job.read_text())["spec"]["model"]["uri"]
        assert named_model(uri) in shipped_names(), job


def test_plan_table_and_json_say_where_the_architecture_came_from(tmp_path, capsys, monkeypatch):
    for key in ("AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3", "HF_HUB_CACHE", "HF_HOME"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    job = ROOT / "examples" / "finetunejob-qlora-mixed.yaml"
    nodes = ROOT / "examples" / "nodes-mixed.yaml"
    assert cli.main(["plan", str(job), "--nodes", str(nodes)]) == 0
    out = capsys.readouterr().out
    assert (
        "Model: llama-3.1-8b (shipped config for s3://models/llama-3.1-8b/): 32 layers, "
        "hidden 4096, 32 heads (8 KV), vocab 128256." in out
    )
    assert "Not read: s3://models/llama-3.1-8b/config.json at http://minio.minio.svc:9000" in out
    assert cli.main(["plan", str(job), "--nodes", str(nodes), "--json"]) == 0
    model = json.loads(capsys.readouterr().out)["model"]
    assert model["source"] == "shipped" and model["location"] == "llama-3.1-8b"
    assert model["uri"] == "s3://models/llama-3.1-8b/" and model["layers"] == 32


def test_plan_exits_2_when_no_source_has_the_architecture(tmp_path, capsys, monkeypatch):
    lora = Job.example("finetunejob-lora").model("s3://models/my-model/")
    job = lora.checkpoint(endpoint=f"http://127.0.0.1:{free_port()}").write(tmp_path / "job.yaml")
    nodes = ROOT / "examples" / "nodes-mixed.yaml"
    assert cli.main(["plan", str(job), "--nodes", str(nodes)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("relaytrain plan: error: cannot find the architecture")
    assert "none is named 'my-model'" in err and "--model-config" in err
