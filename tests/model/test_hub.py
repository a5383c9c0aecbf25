"""`ORG/NAME` model names from the local Hugging Face cache (a fake cache laid out as
huggingface_hub lays it out), and the presets of the models people bring for long documents."""

from __future__ import annotations

import pytest
import torch

from ringctx.model.presets import get_preset
from ringctx.hub import looks_like_repo_id
from ringctx.model import load_model
from ringctx.planning.prefill_plan import plan_prefill, resolve_model_config
from tests.helpers import rel_err
from tests.model.test_model_families import prompt, random_hf_model


@pytest.fixture
def hub_cache(tmp_path, monkeypatch):
    """An HF_HUB_CACHE holding org/tiny-qwen3 at revision abc123 (refs/main points to it)."""
    from huggingface_hub import constants

    cache = tmp_path / "hub"
    repo = cache / "models--org--tiny-qwen3"
    snapshot = repo / "snapshots" / "abc123"
    snapshot.mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("abc123")
    hf = random_hf_model("qwen3-yarn-tied")
    hf.save_pretrained(snapshot)
    # huggingface_hub reads its environment once, at import: set both for this process and children.
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    return cache, snapshot, hf


def test_org_name_loads_from_the_cache_even_offline(hub_cache, monkeypatch):
    from huggingface_hub import constants

    cache, snapshot, hf = hub_cache
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    model = load_model("org/tiny-qwen3", dtype="float32", device="cpu")
    assert model.source == str(snapshot) and model.config.qk_norm
    ids = prompt(40)
    with torch.no_grad():
        assert rel_err(model.logits(ids), hf(ids[None]).logits[0]) < 1e-4
    assert resolve_model_config("org/tiny-qwen3").fingerprint() == model.config.fingerprint()


def test_uncached_name_is_one_line_naming_the_cache_and_the_fetch_command(hub_cache):
    cache, _, _ = hub_cache
    for call in (lambda: load_model("org/missing", device="cpu"), lambda: resolve_model_config("org/missing")):
        with pytest.raises(FileNotFoundError) as info:
            call()
        message = str(info.value)
        assert "\n" not in message and str(cache) in message and "huggingface-cli download org/missing" in message


def test_cli_shows_the_uncached_name_whole(hub_cache):
    """The command line prints the same line, the quoted name included."""
    from click.testing import CliRunner

    from ringctx.cli import main

    result = CliRunner().invoke(main, ["prefill", "--model", "org/missing", "--tokens", "10", "--nproc", "1"])
    assert result.exit_code != 0
    assert "Error: 'org/missing' is not in the local Hugging Face cache" in result.output, result.output


def test_what_counts_as_a_name(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert looks_like_repo_id("Qwen/Qwen3-8B") and looks_like_repo_id("meta-llama/Llama-3.1-8B")
    (tmp_path / "local").mkdir()
    (tmp_path / "local" / "model").mkdir()
    assert not looks_like_repo_id("local/model")  # an existing path stays a path
    assert not any(map(looks_like_repo_id, ("a/b/c", "/abs/path", "./x/y", "file.gguf", "dir/m.gguf")))


@pytest.mark.parametrize("name,params", [("llama3.1-8b", 8_030_261_248), ("qwen3-8b", 8_190_735_360),
                                         ("qwen2.5-7b-instruct-1m", 7_615_616_512)])
def test_presets_have_the_published_shapes_and_plan(name, params):
    """The parameter counts the model cards publish follow from the shapes (a shape typo shows)."""
    config = get_preset(name)
    assert config.n_params == params
    assert config.qk_norm == (name == "qwen3-8b") and config.qkv_bias == name.startswith("qwen2.5")
    plan = plan_prefill(config, 4, "h100-rdma", tokens=131072, chunk_tokens=32768)
    assert plan is not None
