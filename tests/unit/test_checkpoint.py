"""A checkpoint is checked before it is measured: its config, its weight files, and that its weights are the model's.

A row of results.json must be what ran. A checkpoint whose config has more
layers than its weights hold would run with random layers and report ``ok``;
a corrupt config.json or safetensors file would fail with a library error
that names no file. Each is one line naming the file (or the weights) here.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from backends.errors import UserError
from backends.model.build import build_model, describe_model, model_vocab_size
from backends.model.configs import check_model_spec, cost_model_for
from backends.specs import ModelSpec

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> Path:
    """The tiny model (4 layers) as a checkpoint on disk."""
    path = tmp_path_factory.mktemp("ckpt") / "tiny"
    build_model(ModelSpec(lora_rank=0), CPU, False).save_pretrained(path)
    return path


def checkpoint_copy(saved: Path, tmp_path: Path, layers: int | None = None) -> Path:
    """A copy of the checkpoint whose config says ``layers`` layers (the weights still hold 4)."""
    path = tmp_path / f"ckpt-{layers}"
    shutil.copytree(saved, path)
    if layers is not None:
        config = json.loads((path / "config.json").read_text())
        types = config["layer_types"]
        config["num_hidden_layers"] = layers
        config["layer_types"] = (types * layers)[:layers]
        (path / "config.json").write_text(json.dumps(config, indent=2))
    return path


def _spec(path: Path, **kw) -> ModelSpec:
    return ModelSpec(name="local", path=str(path), **kw)


# ---------------------------------------------------------------- weights the config needs and the files lack


def test_a_checkpoint_missing_layers_is_refused_before_loading_naming_the_weights(saved, tmp_path):
    """Config: 6 layers, weights: 4. Checked from the file headers (no weight read), then again by the real load."""
    spec = _spec(checkpoint_copy(saved, tmp_path, layers=6))
    with pytest.raises(UserError) as info:
        model_vocab_size(spec)  # what the harness and the server call before any process starts
    message = str(info.value)
    assert message.startswith("model.path: ") and "\n" not in message
    assert "missing" in message and "model.layers.4." in message and "model.allow_missing_weights=true" in message
    # the load itself refuses too (a backend built without the harness), on every place a checkpoint is read to
    for place in ("device", "cpu"):
        with pytest.raises(UserError, match=r"model.path: .*missing.*model\.layers\.4\."):
            build_model(spec, CPU, False, place=place)


def test_a_checkpoint_with_weights_the_model_does_not_have_is_refused(saved, tmp_path):
    """Config: 2 layers, weights: 4. The extra layers would be dropped without a word."""
    spec = _spec(checkpoint_copy(saved, tmp_path, layers=2))
    with pytest.raises(UserError, match=r"model.path: .*unexpected.*model\.layers\.2\.") as info:
        model_vocab_size(spec)
    assert "\n" not in str(info.value)
    with pytest.raises(UserError, match=r"unexpected.*model\.layers\.2\."):
        build_model(spec, CPU, False)


def test_allowed_missing_weights_are_listed_in_what_was_built(saved, tmp_path):
    spec = _spec(checkpoint_copy(saved, tmp_path, layers=6), allow_missing_weights=True)
    assert model_vocab_size(spec) == 2048  # the check lets it through
    model = build_model(spec, CPU, False)
    built = describe_model(model, spec)
    assert built["n_layers"] == 6
    missing = built["missing_weights"]
    assert (
        missing == sorted(missing)
        and missing
        and all(k.startswith(("model.layers.4.", "model.layers.5.")) for k in missing)
    )
    assert "model.layers.5.input_layernorm.weight" in missing
    assert built["unexpected_weights"] == []


def test_a_complete_checkpoint_records_no_missing_weights_and_the_tiny_model_none(saved):
    built = describe_model(build_model(_spec(saved), CPU, False), _spec(saved))
    assert built["missing_weights"] == [] and built["unexpected_weights"] == []
    tiny = describe_model(build_model(ModelSpec(), CPU, False), ModelSpec())
    assert tiny["missing_weights"] is None and tiny["unexpected_weights"] is None  # nothing was read


# ---------------------------------------------------------------- files that are not what they say


def test_a_corrupt_config_json_is_one_line_naming_the_file(saved, tmp_path):
    path = checkpoint_copy(saved, tmp_path)
    text = (path / "config.json").read_text()
    (path / "config.json").write_text(text[: len(text) // 2])
    spec = _spec(path)
    for check in (model_vocab_size, cost_model_for, lambda s: build_model(s, CPU, False),
                  lambda s: build_model(s, CPU, False, place="meta")):
        with pytest.raises(UserError) as info:
            check(spec)
        message = str(info.value)
        assert message.startswith("model.path: ") and str(path / "config.json") in message, message
        assert "not valid JSON" in message and "line " in message and "\n" not in message


@pytest.mark.parametrize("content, config", [("[1, 2]", True), ('{"hidden_size": 64}', True), ("\xff\xfe", False)])
def test_a_config_json_transformers_cannot_read_names_the_file(saved, tmp_path, content, config):
    path = checkpoint_copy(saved, tmp_path)
    if config:
        (path / "config.json").write_text(content)
    else:
        (path / "config.json").write_bytes(b"\xff\xfe{}")
    with pytest.raises(UserError) as info:
        model_vocab_size(_spec(path))
    assert str(path / "config.json") in str(info.value) and "\n" not in str(info.value)


@pytest.mark.parametrize("cut", ["half", "header", "empty"])
def test_a_corrupt_safetensors_file_is_one_line_naming_the_file(saved, tmp_path, cut):
    path = checkpoint_copy(saved, tmp_path)
    weights = path / "model.safetensors"
    data = weights.read_bytes()
    header = 8 + int.from_bytes(data[:8], "little")
    weights.write_bytes({"half": data[: len(data) // 2], "header": data[: header // 2], "empty": b""}[cut])
    for check in (model_vocab_size, lambda s: build_model(s, CPU, False)):
        with pytest.raises(UserError) as info:
            check(_spec(path))
        message = str(info.value)
        assert message.startswith("model.path: ") and str(weights) in message and "\n" not in message, message
        assert "safetensors" in message


def test_a_checkpoint_without_weights_or_with_a_missing_shard_names_what_is_missing(saved, tmp_path):
    path = checkpoint_copy(saved, tmp_path)
    (path / "model.safetensors").rename(path / "model-00001-of-00002.safetensors")
    with pytest.raises(UserError, match=r"model.path: .* no weights \(expected model.safetensors"):
        model_vocab_size(_spec(path))
    index = {"metadata": {}, "weight_map": {"model.norm.weight": "model-00001-of-00002.safetensors",
                                            "lm_head.weight": "model-00002-of-00002.safetensors"}}
    (path / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(UserError, match=r"model.safetensors.index.json names .*model-00002-of-00002.safetensors"):
        model_vocab_size(_spec(path))
    (path / "model.safetensors.index.json").write_text("{")
    with pytest.raises(UserError, match=r"model.safetensors.index.json is not valid JSON"):
        model_vocab_size(_spec(path))


def test_a_sharded_checkpoint_passes_the_check(saved, tmp_path):
    path = tmp_path / "sharded"
    build_model(ModelSpec(lora_rank=0), CPU, False).save_pretrained(path, max_shard_size="200KB")
    assert (path / "model.safetensors.index.json").is_file() and len(list(path.glob("*.safetensors"))) > 1
    assert model_vocab_size(_spec(path)) == 2048


# ---------------------------------------------------------------- settings a checkpoint ignores


def test_vocab_size_with_a_checkpoint_is_refused(saved):
    spec = _spec(saved, vocab_size=4096)
    for check in (check_model_spec, model_vocab_size, lambda s: build_model(s, CPU, False)):
        with pytest.raises(UserError, match=r"model.vocab_size: .*tiny model.*model.path=null.*2048") as info:
            check(spec)
        assert "\n" not in str(info.value)
    check_model_spec(ModelSpec(vocab_size=4096))  # the tiny model takes it


def llama_checkpoint(path: Path) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=2048, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        LlamaForCausalLM(config).save_pretrained(path)
    return path


def test_packed_layout_on_an_architecture_it_does_not_keep_apart_is_refused_from_the_config(tmp_path):
    """Checked from config.json alone (torch-free, before any weight is read); layout=padded is fine."""
    spec = _spec(llama_checkpoint(tmp_path / "llama"))
    with pytest.raises(UserError) as info:
        check_model_spec(spec, layout="packed")
    message = str(info.value)
    assert message.startswith("layout: packed") and "'llama'" in message and "layout=padded" in message
    assert "qwen3_5_moe" in message and "\n" not in message
    check_model_spec(spec, layout="padded")
    check_model_spec(ModelSpec(), layout="packed")  # the tiny Qwen3.5-MoE
    check_model_spec(ModelSpec(name="qwen3_5_35b_a3b", path=str(tmp_path / "not-on-disk")), layout="packed")


def test_a_packed_row_on_a_model_that_cannot_keep_it_apart_fails_naming_the_layout(tmp_path):
    """Past the config check (a backend driven directly): one clear error, not an AttributeError in the mask code."""
    from backends.model.packing import check_packable
    from backends.model.step import run_schedule
    from harness.data.workload import make_examples

    spec = _spec(llama_checkpoint(tmp_path / "llama"), lora_rank=0)
    model = build_model(spec, CPU, False)
    with pytest.raises(ValueError, match=r"layout=packed .*LlamaForCausalLM.*layout=padded"):
        check_packable(model)
    examples = make_examples([5, 7], 2048, seed=0)
    with pytest.raises(ValueError, match=r"layout=packed .*LlamaForCausalLM"):
        run_schedule(model, examples, [[0, 1]], "forward", 1.0, CPU, layout="packed")
    check_packable(build_model(ModelSpec(), CPU, False))


def test_a_config_and_weights_of_different_shapes_are_refused_naming_the_shapes(saved, tmp_path):
    path = checkpoint_copy(saved, tmp_path)
    config = json.loads((path / "config.json").read_text())
    config["hidden_size"] = 128
    (path / "config.json").write_text(json.dumps(config))
    spec = _spec(path, allow_missing_weights=True)  # a weight of another shape is not a missing one
    with pytest.raises(UserError, match=r"model.path: .* of another shape \(lm_head.weight \(2048, 64\) in the files, "
                                        r"\(2048, 128\) in the model") as info:
        model_vocab_size(spec)
    assert "\n" not in str(info.value)


def _hub_layout(saved: Path, path: Path, drop: str | None = None) -> Path:
    """The tiny checkpoint as the published Qwen3.5-MoE one is laid out: a composite config, the text model under
    model.language_model, one tensor per expert, and multi-token-prediction weights the causal LM does not use."""
    from safetensors.torch import load_file, save_file

    path.mkdir()
    text = json.loads((saved / "config.json").read_text())
    (path / "config.json").write_text(
        json.dumps(
            {
                "model_type": "qwen3_5_moe",
                "architectures": ["Qwen3_5MoeForConditionalGeneration"],
                "text_config": text,
                "tie_word_embeddings": False,
            }
        )
    )
    tensors = {}
    for name, t in load_file(saved / "model.safetensors").items():
        name = name.replace("model.", "model.language_model.", 1) if name.startswith("model.") else name
        if name.endswith("mlp.experts.gate_up_proj"):
            half = t.shape[1] // 2
            for e in range(t.shape[0]):
                tensors[name.replace("gate_up_proj", f"{e}.gate_proj.weight")] = t[e, :half].contiguous()
                tensors[name.replace("gate_up_proj", f"{e}.up_proj.weight")] = t[e, half:].contiguous()
        elif name.endswith("mlp.experts.down_proj"):
            for e in range(t.shape[0]):
                tensors[name.replace("down_proj", f"{e}.down_proj.weight")] = t[e].contiguous()
        else:
            tensors[name] = t
    tensors["mtp.fc.weight"] = torch.zeros(4, 4)
    if drop is not None:
        tensors = {k: v for k, v in tensors.items() if not k.startswith(drop)}
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    return path


def test_the_check_reads_the_published_layout_as_transformers_loads_it(saved, tmp_path):
    """Renamed prefixes, experts fused on load and ignored mtp.* weights count as in the real load: nothing missing."""
    spec = _spec(_hub_layout(saved, tmp_path / "hub"))
    assert model_vocab_size(spec) == 2048
    loaded, reference = build_model(spec, CPU, False), build_model(_spec(saved), CPU, False)
    assert describe_model(loaded, spec)["missing_weights"] == []
    state = reference.state_dict()
    assert all(torch.equal(t, state[n]) for n, t in loaded.state_dict().items())
    # a layer the files lack is missing there too, under the model's own names
    short = _spec(_hub_layout(saved, tmp_path / "short", drop="model.language_model.layers.3."))
    with pytest.raises(UserError, match=r"missing \(model\.layers\.3\."):
        model_vocab_size(short)


def test_packed_layout_takes_a_composite_config_by_either_model_type(tmp_path):
    """The published checkpoint's config.json is composite (qwen3_5_moe at the top, a text_config inside)."""
    from backends.model.configs import QWEN3_5_35B_A3B_TEXT_CONFIG

    text = {k: v for k, v in QWEN3_5_35B_A3B_TEXT_CONFIG.items() if k != "model_type"}
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen3_5_moe", "text_config": text}))
    check_model_spec(ModelSpec(name="qwen3_5_35b_a3b", path=str(tmp_path)), layout="packed")
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llava", "text_config": {"model_type": "llama"}}))
    with pytest.raises(UserError, match=r"says model_type 'llama'"):
        check_model_spec(ModelSpec(name="x", path=str(tmp_path)), layout="packed")


def test_a_check_that_cannot_run_on_meta_tensors_leaves_it_to_the_load(saved, tmp_path, monkeypatch, caplog):
    """The check runs ahead of the load and must never refuse what would load: the load's own report still refuses."""
    import logging

    from transformers import Qwen3_5MoeForCausalLM

    def fails(*args, **kwargs):
        raise NotImplementedError("an operation with no meta kernel")

    path = checkpoint_copy(saved, tmp_path, layers=6)
    with monkeypatch.context() as patch:
        patch.setattr(Qwen3_5MoeForCausalLM, "from_pretrained", fails)
        with caplog.at_level(logging.WARNING, logger="backends.model.checkpoint"):
            assert model_vocab_size(_spec(path)) == 2048
    assert any("could not be checked before loading" in r.getMessage() for r in caplog.records)
    with pytest.raises(UserError, match=r"missing.*model\.layers\.4\."):
        build_model(_spec(path), CPU, False)
