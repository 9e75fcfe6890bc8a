"""``check_packable`` and ``prepare_model_for_packing`` on a representative few of the model types
scripts/packing_sweep.py runs over every causal LM transformers builds: each accepted or prepared model's packed rows
equal each sequence alone (the sweep's own measure, not the library's probe), and every other model is refused in one
line ``ValueError``. The families are the sweep's kinds of answer: exact as is (Llama), exact once prepared (OPT's
learned positions, GPT-OSS's attention sinks), a sliding window kept once prepared (Mistral), soft-capping (Gemma 2),
refused (MPT and BLOOM's ALiBi, Mamba's recurrent state)."""

from __future__ import annotations

import pytest
import torch

from balance_batch.integrations.transformers import (
    check_packable,
    is_prepared_for_packing,
    prepare_model_for_packing,
)
from scripts.packing_sweep import build, model_types, worst_difference

TYPES = model_types()


def tiny(model_type: str, window=None, dtype=torch.float32) -> torch.nn.Module:
    return build(model_type, TYPES[model_type], window, dtype)


def one_line_value_error(call, model) -> str:
    with pytest.raises(ValueError) as error:
        call(model)
    assert "\n" not in str(error.value)
    return str(error.value)


@pytest.mark.parametrize("model_type, window", [("opt", None), ("gpt_oss", 4), ("mistral", 4), ("gemma2", 4)])
def test_prepared_models_give_each_sequence_what_it_gives_alone(model_type, window):
    model = tiny(model_type, window)
    prepare_model_for_packing(model)
    assert is_prepared_for_packing(model)
    check_packable(model)
    assert worst_difference(model) <= 1e-4
    assert prepare_model_for_packing(model) is model and worst_difference(model) <= 1e-4  # idempotent


def test_models_whose_packed_sequences_see_each_other_are_refused_and_left_as_they_were():
    opt = tiny("opt")
    assert worst_difference(opt) > 0.01  # OPT's positions come from the row, not position_ids: wrong as it comes
    assert "a packed sequence sees the one before it" in one_line_value_error(check_packable, opt)
    for model_type in ("mpt", "bloom"):
        model = tiny(model_type)
        implementation = model.config._attn_implementation
        for refuse in (check_packable, prepare_model_for_packing):
            assert "packed" in one_line_value_error(refuse, model)
        assert model.config._attn_implementation == implementation and not is_prepared_for_packing(model)


def test_a_recurrent_state_is_refused_for_what_it_is():
    mamba = tiny("mamba")
    for refuse in (check_packable, prepare_model_for_packing):
        message = one_line_value_error(refuse, mamba)
        assert "MambaMixer layers carry a recurrent state" in message and "attention mask" not in message


def test_each_prepared_model_runs_its_own_attention_whatever_was_prepared_before():
    """Sinks (GPT-OSS, eager) then soft-capping (Gemma 2, eager) in one process: each model's per-sequence attention
    is its own modeling module's, not the first prepared model's."""
    first, second = tiny("gpt_oss"), tiny("gemma2")
    first.config._attn_implementation = second.config._attn_implementation = "eager"
    for model in (first, second):
        prepare_model_for_packing(model)
        assert model.config._attn_implementation == "packed_eager"
    for model in (first, second):
        assert worst_difference(model) <= 1e-4


def test_the_probe_decides_in_bf16_as_in_float32():
    """bf16, the published setting: a stock Llama accepted and prepared, OPT refused as it comes (its leak changes
    the neighbour's bf16 logits, which the probe compares bit for bit) and exact once prepared."""
    llama = tiny("llama", dtype=torch.bfloat16)
    check_packable(llama)
    prepare_model_for_packing(llama)
    opt = tiny("opt", dtype=torch.bfloat16)
    one_line_value_error(check_packable, opt)
    prepare_model_for_packing(opt)
    check_packable(opt)
    assert worst_difference(opt) == 0  # per-sequence attention: each sequence's own computation, bit for bit


def test_the_probe_leaves_the_random_state_and_the_training_mode_as_they_were():
    model = tiny("llama").train()
    state = torch.random.get_rng_state()
    check_packable(model)
    assert model.training and torch.equal(torch.random.get_rng_state(), state)


def test_the_sweep_judges_rows_and_writes_the_docs_table_from_them(tmp_path, capsys):
    """scripts/packing_sweep.py end to end on two model types: its rows, its exit status, and the table it writes
    between a page's markers from the rows of its shards."""
    from scripts.packing_sweep import BEGIN, END, main

    first, second = tmp_path / "1.json", tmp_path / "2.json"
    assert main(["--only", "llama,mpt", "--no-windows", "--shard", "1/2", "--json", str(first)]) == 0
    assert main(["--only", "llama,mpt", "--no-windows", "--shard", "2/2", "--json", str(second)]) == 0
    page = tmp_path / "page.md"
    page.write_text(f"before\n{BEGIN}\nold\n{END}\nafter\n", encoding="utf-8")
    assert main(["--rows-from", str(first), str(second), "--write-docs", str(page)]) == 0
    text = page.read_text(encoding="utf-8")
    assert "old" not in text and text.startswith("before\n") and text.endswith(f"{END}\nafter\n")
    assert "| llama | LlamaForCausalLM | exact as is |" in text
    assert "| mpt | MptForCausalLM | refused |" in text and "a packed sequence sees the one before it" in text
