"""The tensor-parallel plan, derived without a process group: which layers are split and how, the head counts made
local, what stays replicated, and the refusals of a plan that cannot apply."""

from __future__ import annotations

import pytest
from torch import nn

from lightning_mgpu.parts.tensor_parallel import TensorParallelism, derive_plan, is_tensor_parallel, matches
from tests.tensor_parallel_models import TinyLlama


def _kinds(plan) -> dict[str, str]:
    return {name: type(style).__name__ for name, style in plan.styles.items()}


def test_llama_style_blocks_get_megatrons_pairing_and_local_head_counts():
    plan = derive_plan(TinyLlama(layers=2), tensor_size=2)
    kinds = _kinds(plan)
    for i in range(2):
        for name in ("attention.wq", "attention.wk", "attention.wv", "feed_forward.w1", "feed_forward.w3"):
            assert kinds.pop(f"layers.{i}.{name}") == "ColwiseParallel"
        for name in ("attention.wo", "feed_forward.w2"):
            assert kinds.pop(f"layers.{i}.{name}") == "RowwiseParallel"
    assert kinds == {}
    assert ("layers.0.attention", "n_heads", 4) in plan.heads and ("layers.1.attention", "n_kv_heads", 2) in plan.heads
    line = plan.summary(2)
    assert "\n" not in line and "layers.*.attention.wq colwise" in line
    assert line.endswith("replicated: tok_embeddings, layers.*.attention_norm, layers.*.ffn_norm, norm, output")


def test_a_block_whose_heads_do_not_divide_stays_replicated_and_says_why():
    plan = derive_plan(TinyLlama(layers=1, n_heads=4, n_kv_heads=2), tensor_size=4)
    assert set(_kinds(plan)) == {"layers.0.feed_forward.w1", "layers.0.feed_forward.w3", "layers.0.feed_forward.w2"}
    assert plan.skipped == ["layers.0.attention (n_kv_heads=2 not divisible by 4)"]
    assert "not split: layers.0.attention (n_kv" in plan.summary(4)


def _transformers():
    return pytest.importorskip("transformers")


def test_a_hugging_face_llama_gets_its_own_base_model_tp_plan():
    t = _transformers()
    config = t.LlamaConfig(
        vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2,
    )  # fmt: skip
    plan = derive_plan(t.LlamaForCausalLM(config), tensor_size=2)
    assert plan.source == "the model's own base_model_tp_plan"
    kinds = _kinds(plan)
    assert kinds["model.layers.1.self_attn.k_proj"] == "ColwiseParallel"
    assert kinds["model.layers.0.mlp.down_proj"] == "RowwiseParallel" and len(kinds) == 14
    assert "lm_head" in plan.replicated and "model.embed_tokens" in plan.replicated


def test_bert_style_attention_and_mlp_are_found_by_their_sibling_output_layers():
    t = _transformers()
    sizes = {"hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 1, "num_attention_heads": 4}
    config = t.BertConfig(vocab_size=32, **sizes)
    kinds = _kinds(derive_plan(t.BertForMaskedLM(config), tensor_size=2))
    layer = "bert.encoder.layer.0"
    assert kinds == {
        f"{layer}.attention.self.query": "ColwiseParallel",
        f"{layer}.attention.self.key": "ColwiseParallel",
        f"{layer}.attention.self.value": "ColwiseParallel",
        f"{layer}.attention.output.dense": "RowwiseParallel",
        f"{layer}.intermediate.dense": "ColwiseParallel",
        f"{layer}.output.dense": "RowwiseParallel",
    }


def test_a_plan_of_your_own_must_name_modules_the_model_has():
    tp = TensorParallelism(size=2, plan={"layers.*.attention.wq": "colwise", "blocks.*.fc": "rowwise"})
    with pytest.raises(ValueError, match=r"\['blocks.\*.fc'\] match no module of TinyLlama"):
        tp.plan_for(TinyLlama())


def test_a_plan_of_your_own_refuses_a_width_the_tensor_size_does_not_divide():
    tp = TensorParallelism(size=3, plan={"layers.*.attention.wq": "colwise"})
    with pytest.raises(ValueError, match=r"layers.0.attention.wq \(colwise\), whose width 8 is not divisible by 3"):
        tp.plan_for(TinyLlama())


def test_patterns_match_one_name_per_star_and_plain_modules_are_not_tensor_parallel():
    assert matches("layers.*.w1", "layers.12.w1") and not matches("layers.*", "layers.1.w1")
    assert not is_tensor_parallel(nn.Linear(2, 2))
    assert TensorParallelism(size=1).apply(nn.Linear(2, 2), mesh=None) is None  # one rank: nothing to do


def test_gpt2s_conv1d_mlp_and_packed_attention_are_split_with_the_attentions_local_widths():
    t = _transformers()
    config = t.GPT2Config(vocab_size=32, n_embd=16, n_layer=1, n_head=4, n_positions=8, bos_token_id=0, eos_token_id=0)
    plan = derive_plan(t.GPT2LMHeadModel(config), tensor_size=2)
    assert {n: repr(s) for n, s in plan.styles.items()} == {
        "transformer.h.0.attn.c_attn": "PackedConv1DColwiseParallel(chunks=3)",
        "transformer.h.0.attn.c_proj": "Conv1DRowwiseParallel()",
        "transformer.h.0.mlp.c_fc": "Conv1DColwiseParallel()",
        "transformer.h.0.mlp.c_proj": "Conv1DRowwiseParallel()",
    }
    # the forward splits c_attn's output by split_size and views it by head: both become the local values
    assert sorted(plan.heads) == [
        ("transformer.h.0.attn", a, v) for a, v in [("embed_dim", 16), ("num_heads", 4), ("split_size", 16)]
    ]
    line = plan.summary(2)
    assert "transformer.h.*.attn.c_attn colwise packed" in line and "c_attn" not in line.split("replicated:")[1]
    # 3 heads do not divide over 2 ranks: the attention stays whole, the start-up line says why
    config = t.GPT2Config(vocab_size=32, n_embd=12, n_layer=1, n_head=3, n_positions=8, bos_token_id=0, eos_token_id=0)
    plan = derive_plan(t.GPT2LMHeadModel(config), tensor_size=2)
    assert "transformer.h.0.attn.c_attn" not in plan.styles and "num_heads=3 not divisible by 2" in plan.summary(2)
