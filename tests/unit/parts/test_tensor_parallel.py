"""The tensor-parallel plan, derived without a process group: which layers are split and how, the head counts made
local, what stays replicated, and the refusals of a plan that cannot apply."""

from __future__ import annotations

import ast

import pytest
import torch
from torch import nn

from lightning_mgpu.parts.tensor_parallel import (
    INPUT_SPLIT,
    TensorParallelism,
    adapter_layers,
    derive_plan,
    guard_sequence_length,
    is_tensor_parallel,
    local_head_counts,
    matches,
    plan_from_patterns,
    split_share,
    suggested_plan,
)
from tests.parts_harness import in_forked_child
from tests.tensor_parallel_models import (
    Block,
    LitConfig,
    LitGPT,
    NanoConfig,
    NanoGPT,
    TimmViT,
    TinyLlama,
    litgpt_model,
    plain_mlp,
)


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


def test_a_plain_mlp_is_split_by_its_structure_and_the_start_up_line_says_the_share():
    mlp = plain_mlp()  # nn.Sequential(Linear, ReLU, Linear, ReLU, Linear): no name the rules know
    plan = derive_plan(mlp, tensor_size=2)
    assert plan.kinds() == {"0": "colwise", "2": "rowwise"}  # the last Linear is the output: whole
    split = 32 * 96 + 32 + 32 * 32  # the first layer's weight and bias, the second's weight (its bias is added whole)
    assert split_share(mlp, plan) == (split, sum(p.numel() for p in mlp.parameters()))  # no embedding: no head aside
    assert "split 2 layers, 88% of the linear layers' parameters" in plan.summary(2, mlp)


def test_litgpts_packed_qkv_and_gated_mlp_are_split_and_each_attention_gets_a_config_of_local_head_counts():
    gpt = LitGPT(LitConfig(n_query_groups=4))
    plan = derive_plan(gpt, tensor_size=2)
    for i in range(2):
        block = f"transformer.h.{i}"
        assert repr(plan.styles[f"{block}.attn.qkv"]) == "PackedLinearColwiseParallel(chunks=3)"
        assert plan.kinds()[f"{block}.attn.proj"] == "rowwise"
        assert [plan.kinds()[f"{block}.mlp.{n}"] for n in ("fc_1", "fc_2", "proj")] == ["colwise", "colwise", "rowwise"]
        assert (f"{block}.attn", "config.n_head", 4) in plan.heads
        assert (f"{block}.attn", "config.n_query_groups", 4) in plan.heads
    assert "10 layers, 93% of the linear layers' parameters" in plan.summary(2, gpt)
    # applied: each attention reads a copy with the local counts; the model's and the blocks' config stay global
    shared = gpt.config
    local_head_counts(gpt, plan, size=2)
    attn = gpt.transformer.h[0].attn
    assert attn.config is not shared and (attn.config.n_head, attn.config.n_query_groups) == (2, 2)
    assert gpt.transformer.h[1].attn.config is not attn.config
    assert (shared.n_head, gpt.transformer.h[0].config.n_head, gpt.transformer.h[0].mlp.config.n_head) == (4, 4, 4)


def test_grouped_query_litgpt_splits_its_attention_by_input_column_and_says_why():
    # litgpt packs q (4 heads) | k (2) | v (2): no equal chunks a rank could take its piece of; the check that runs the
    # attention as each rank would finds the shares do not add up, so qkv and proj are split by input column (the heads
    # computed whole, the head counts left as they are). Its MLP is split by heads' Megatron pairing
    model = LitGPT(LitConfig(n_query_groups=2))
    plan = derive_plan(model, tensor_size=2)
    kinds = {f"transformer.h.{i}.mlp.{n}": k for i in range(2) for n, k in [("fc_1", "colwise"), ("fc_2", "colwise"),
             ("proj", "rowwise")]}  # fmt: skip
    kinds |= {f"transformer.h.{i}.attn.{n}": INPUT_SPLIT for i in range(2) for n in ("qkv", "proj")}
    assert plan.kinds() == kinds
    assert plan.heads == [] and plan.skipped == []
    line = plan.summary(2, model)
    assert "92% of the linear layers' parameters" in line
    assert (
        "heads whole (split by input column): transformer.h.*.attn (its forward does not compute the split pair: "
        in (line)
    )
    # the weights split by input column count in the share split (their biases, added after the sum, would not)
    assert "transformer.h.0.attn.qkv.weight" in plan.split_parameters(model)
    # a plan to paste names the split Hugging Face's way ("rowwise_rep"), and that plan resolves to the same split
    pasted = suggested_plan(model, plan, 2)
    assert pasted["transformer.h.*.attn.qkv"] == pasted["transformer.h.*.attn.proj"] == "rowwise_rep"
    assert plan_from_patterns(model, pasted, "your plan").kinds() == kinds
    # head counts the tensor size does not divide: the same fallback, the count named
    four = derive_plan(model, tensor_size=4)
    assert four.kinds()["transformer.h.1.attn.qkv"] == INPUT_SPLIT and four.heads == []
    assert four.input_split[0] == "transformer.h.0.attn (n_query_groups=2 not divisible by 4)"


def _nano_plan_kinds() -> dict[str, str]:
    return {
        f"transformer.h.{i}.{n}": k
        for i in range(2)
        for n, k in [("attn.c_attn", "colwise packed"), ("attn.c_proj", "rowwise"), ("mlp.c_fc", "colwise"),
                     ("mlp.c_proj", "rowwise")]
    }  # fmt: skip


def test_nanogpts_attention_is_split_with_a_local_forward_checked_against_its_own(monkeypatch):
    # nanoGPT's forward reads the width from its input (view(B, T, C)), so no local attribute makes a rank's share
    # right; its attention runs nanoGPT's computation with local heads and width instead, checked against its own
    nano = NanoGPT(NanoConfig())
    plan = derive_plan(nano, tensor_size=2)
    assert plan.kinds() == _nano_plan_kinds() and plan.skipped == []
    assert repr(plan.styles["transformer.h.0.attn.c_attn"]) == "PackedLinearColwiseParallel(chunks=3)"
    assert sorted(h for h in plan.heads if h[0] == "transformer.h.1.attn") == [
        ("transformer.h.1.attn", "n_embd", 16), ("transformer.h.1.attn", "n_head", 4)
    ]  # fmt: skip
    assert set(plan.forwards) == {"transformer.h.0.attn", "transformer.h.1.attn"}
    assert "8 layers, 98% of the linear layers' parameters" in plan.summary(2, nano)
    local_head_counts(nano, plan, size=2)  # applied: the local counts, and the local forward on each attention
    attn = nano.transformer.h[0].attn
    assert (attn.n_head, attn.n_embd) == (2, 8) and attn.forward.__func__ is plan.forwards["transformer.h.0.attn"]
    assert "forward" not in vars(NanoGPT(NanoConfig()).transformer.h[0].attn)  # deriving the plan installed nothing
    # nanoGPT without flash attention (an older torch): the masked path with its causal-mask buffer is split alike
    monkeypatch.delattr(torch.nn.functional, "scaled_dot_product_attention")
    masked = NanoGPT(NanoConfig())
    monkeypatch.undo()
    assert not masked.transformer.h[0].attn.flash and masked.transformer.h[0].attn.bias.shape == (1, 1, 8, 8)
    plan = derive_plan(masked, tensor_size=2)
    assert plan.kinds() == _nano_plan_kinds() and set(plan.forwards) == {f"transformer.h.{i}.attn" for i in range(2)}


@pytest.mark.parametrize("change", ["not causal", "another scale", "a mask of its own"])
def test_an_attention_laid_out_as_nanogpts_that_computes_otherwise_keeps_its_heads_whole_and_says_why(change: str):
    # negative control: the same layers and attributes as nanoGPT's attention, another computation; the check runs
    # the module's own forward whole against nanoGPT's with local heads as each rank, and refuses the head split: the
    # attention's layers are split by input column instead, its own forward running on whole heads
    from torch.nn import functional as F

    from tests.tensor_parallel_models import NanoCausalSelfAttention

    class Variant(NanoCausalSelfAttention):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            B, T, C = x.size()
            q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in self.c_attn(x).split(C, 2))
            if change == "not causal":
                y = F.scaled_dot_product_attention(q, k, v, is_causal=False)
            elif change == "another scale":
                y = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=1.0)
            else:  # a mask of its own: each position attends to itself only
                y = F.softmax((q @ k.transpose(-2, -1)).masked_fill(self.bias[:, :, :T, :T] == 0, -1e9), -1) @ v
            return self.resid_dropout(self.c_proj(y.transpose(1, 2).contiguous().view(B, T, C)))

    nano = NanoGPT(NanoConfig())
    for block in nano.transformer.h:
        block.attn.__class__ = Variant
        block.attn.register_buffer("bias", torch.eye(8).view(1, 1, 8, 8))  # flash stays True: nanoGPT ignores it
    plan = derive_plan(nano, tensor_size=2)
    kinds = plan.kinds()
    assert {n for n, k in kinds.items() if k != INPUT_SPLIT} == {
        f"transformer.h.{i}.mlp.{n}" for i in range(2) for n in ("c_fc", "c_proj")
    }
    assert {n for n, k in kinds.items() if k == INPUT_SPLIT} == {
        f"transformer.h.{i}.attn.{n}" for i in range(2) for n in ("c_attn", "c_proj")
    }
    assert plan.forwards == {} and plan.heads == [] and plan.skipped == []
    line = plan.summary(2)
    assert (
        "heads whole (split by input column): transformer.h.*.attn (its forward does not compute the split pair: "
        in (line)
    )
    assert "RuntimeError: shape " in line
    assert (
        "; nor does nanoGPT's attention with its local heads: the ranks' shares do not add up to the whole output "
        "(its own forward computes something else))" in line
    )


def test_timms_vit_attention_is_split_with_its_local_heads_and_width():
    vit = TimmViT()
    plan = derive_plan(vit, tensor_size=2)
    assert repr(plan.styles["blocks.0.attn.qkv"]) == "PackedLinearColwiseParallel(chunks=3)"
    assert plan.kinds()["blocks.1.attn.proj"] == "rowwise" and plan.kinds()["blocks.1.mlp.fc1"] == "colwise"
    assert sorted(h for h in plan.heads if h[0] == "blocks.0.attn") == [
        ("blocks.0.attn", "attn_dim", 16), ("blocks.0.attn", "num_heads", 4)
    ]  # fmt: skip
    assert "8 layers, 94% of the linear layers' parameters" in plan.summary(2, vit)


def test_a_norm_or_a_second_consumer_between_two_linear_layers_keeps_them_whole():
    class Normed(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.up, self.norm, self.down = nn.Linear(8, 16), nn.LayerNorm(16), nn.Linear(16, 8)

        def forward(self, x):
            return self.down(self.norm(self.up(x)))

    class Leaky(nn.Module):  # the hidden units also leave the module: a rank holds only its share of them
        def __init__(self) -> None:
            super().__init__()
            self.up, self.down = nn.Linear(8, 16), nn.Linear(16, 8)

        def forward(self, x):
            h = torch.relu(self.up(x))
            return self.down(h), h.sum(-1)

    class Residual(nn.Module):  # the whole input added to the hidden units
        def __init__(self) -> None:
            super().__init__()
            self.up, self.down = nn.Linear(8, 8), nn.Linear(8, 8)

        def forward(self, x):
            return self.down(self.up(x) + x)

    class Plain(Leaky):
        def forward(self, x):
            return self.down(torch.relu(self.up(x)))

    assert derive_plan(Plain(), tensor_size=2).kinds() == {"up": "colwise", "down": "rowwise"}
    for model in (Normed(), Leaky(), Residual()):
        assert derive_plan(model, tensor_size=2).styles == {}, type(model).__name__


def test_finding_the_structure_leaves_the_random_state_the_training_mode_and_the_weights_as_they_were():
    torch.manual_seed(5)
    model = TimmViT().train()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    state = torch.get_rng_state()
    assert "blocks.0.attn.qkv" in derive_plan(model, tensor_size=2).styles  # one forward ran
    assert torch.equal(torch.get_rng_state(), state)
    assert all(m.training for m in model.modules())
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())


def test_the_litgpt_copy_computes_as_litgpt_itself():
    pytest.importorskip("litgpt")
    torch.manual_seed(0)
    real = litgpt_model(2)
    copy = LitGPT(LitConfig(n_query_groups=2))
    copy.load_state_dict(real.state_dict())
    tokens = torch.randint(16, (2, 6))
    torch.testing.assert_close(copy(tokens), real(tokens))


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


def test_auto_sequence_adds_torchtitans_sequence_parallel_layout_to_a_llama_style_model():
    from torch.distributed.tensor import Replicate, Shard

    plan = TensorParallelism(size=2, plan="auto+sequence").plan_for(TinyLlama(layers=2))
    kinds = _kinds(plan)
    assert plan.vocab_parallel and plan.replicated == [] and plan.sequence_entry == "tok_embeddings"
    assert kinds.pop("tok_embeddings") == "RowwiseParallel" and kinds.pop("output") == "ColwiseParallel"
    assert kinds.pop("norm") == "SequenceParallel"
    for i in range(2):
        for name in ("attention_norm", "ffn_norm"):
            assert kinds.pop(f"layers.{i}.{name}") == "SequenceParallel"
        for name in ("attention", "feed_forward"):
            assert kinds.pop(f"layers.{i}.{name}") == "PrepareModuleInput"
            gather = plan.styles[f"layers.{i}.{name}"]
            assert gather.input_layouts == (Shard(1),) and gather.desired_input_layouts == (Replicate(),)
        for name in ("attention.wo", "feed_forward.w2"):
            assert kinds.pop(f"layers.{i}.{name}") == "RowwiseParallel"
            assert plan.styles[f"layers.{i}.{name}"].output_layouts == (Shard(1),)  # reduce-scattered
    assert set(kinds.values()) == {"ColwiseParallel"} and len(kinds) == 10  # wq, wk, wv, w1, w3 of each block
    assert plan.styles["tok_embeddings"].output_layouts == (Shard(1),)
    head = plan.styles["output"]
    assert head.input_layouts == (Shard(1),) and head.output_layouts == (Shard(-1),) and not head.use_local_output
    assert ("layers.1.attention", "n_kv_heads", 2) in plan.heads
    assert "sequence parallelism" in plan.summary(2) and "layers.*.ffn_norm sequence_parallel" in plan.summary(2)


def test_auto_sequence_refuses_a_model_it_cannot_lay_out_naming_what_did_not_match():
    tp = TensorParallelism(size=2, plan="auto+sequence")
    with pytest.raises(
        ValueError, match=r"needs a Llama-style model.*Hugging Face GPT-2.*Sequential is none.*plan='auto'"
    ):
        tp.plan_for(nn.Sequential(nn.Linear(4, 4)))
    tied = TinyLlama()
    tied.output.weight = tied.tok_embeddings.weight  # both split by vocabulary row: the head takes it again
    assert tp.plan_for(tied).tied == [("output", "tok_embeddings")] and tp.plan_for(TinyLlama()).tied == []
    with pytest.raises(ValueError, match=r"block layers.0 must hold only norms.*n_kv_heads=2 not divisible by 4"):
        TensorParallelism(size=4, plan="auto+sequence").plan_for(TinyLlama(layers=1))
    table = TinyLlama()
    table.register_buffer("positions", torch.zeros(6, 8))  # a position table the forward could add to the sequence
    with pytest.raises(ValueError, match=r"holds buffers \(its own; a position table"):
        tp.plan_for(table)
    extra = TinyLlama(layers=1)
    extra.layers[0].gate = nn.Linear(8, 8)  # a layer the plan does not know sits in the block
    with pytest.raises(
        ValueError, match=r"it holds \['attention', 'attention_norm', 'feed_forward', 'ffn_norm', 'gate'\]"
    ):
        tp.plan_for(extra)


def test_a_sequence_the_tensor_size_does_not_divide_is_refused_at_the_embedding():
    embedding = nn.Embedding(16, 8)
    guard_sequence_length(embedding, 2)
    assert embedding(torch.zeros(3, 6, dtype=torch.long)).shape == (3, 6, 8)
    with pytest.raises(ValueError, match=r"sequence length is 7. Pad or crop the sequences to a multiple of 2"):
        embedding(torch.zeros(3, 7, dtype=torch.long))


def test_auto_sequence_cuts_a_hugging_face_llama_after_its_positions_are_computed():
    from torch.distributed.tensor import Replicate, Shard

    t = _transformers()
    config = t.LlamaConfig(
        vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2,
    )  # fmt: skip
    plan = TensorParallelism(size=2, plan="auto+sequence").plan_for(t.LlamaForCausalLM(config))
    assert plan.vocab_parallel and plan.sequence_entry == "model.embed_tokens" and plan.replicated == []
    assert plan.styles["model.embed_tokens"].output_layouts == (Replicate(),)  # whole: positions and mask need it
    cut = plan.styles["model.layers.0"]
    assert cut.input_layouts == (Replicate(),) and cut.desired_input_layouts == (Shard(1),) and cut.use_local_output
    attention = plan.styles["model.layers.1.self_attn"]  # called with hidden_states= as a keyword
    assert attention.input_kwarg_layouts == {"hidden_states": Shard(1)}
    assert plan.styles["model.layers.1.mlp"].input_layouts == (Shard(1),)
    assert _kinds(plan)["model.layers.1.post_attention_layernorm"] == "SequenceParallel"
    assert plan.styles["lm_head"].output_layouts == (Shard(-1),)


def test_auto_sequence_lays_out_a_hugging_face_gpt2_with_its_tied_head_and_refuses_a_bert():
    from torch.distributed.tensor import Replicate, Shard

    t = _transformers()
    config = t.GPT2Config(vocab_size=32, n_embd=16, n_layer=2, n_head=4, n_positions=8, bos_token_id=0, eos_token_id=0)
    model = t.GPT2LMHeadModel(config)
    plan = TensorParallelism(size=2, plan="auto+sequence").plan_for(model)
    assert plan.vocab_parallel and plan.sequence_entry == "transformer.wte"
    assert plan.tied == [("lm_head", "transformer.wte")]  # the head takes the embedding's split weight again
    assert plan.replicated == ["transformer.wpe"]  # the position table: whole, added to the whole sequence
    assert plan.styles["transformer.wte"].output_layouts == (Replicate(),)  # whole: positions and mask need it
    assert repr(plan.styles["transformer.h.0"]) == "SequenceCut(Replicate() -> Shard(1))"  # the first block cuts
    assert "transformer.h.1" not in plan.styles
    for i in range(2):
        for name in ("ln_1", "ln_2"):
            assert type(plan.styles[f"transformer.h.{i}.{name}"]).__name__ == "SequenceParallel"
        for name in ("attn", "mlp"):  # called with the hidden states as the first positional argument
            assert plan.styles[f"transformer.h.{i}.{name}"].input_layouts == (Shard(1),)
        for name in ("attn.c_proj", "mlp.c_proj"):  # reduce-scattered back onto the sequence
            assert repr(plan.styles[f"transformer.h.{i}.{name}"]) == "Conv1DRowwiseParallel(output_layouts=Shard(1))"
        assert repr(plan.styles[f"transformer.h.{i}.attn.c_attn"]) == "PackedConv1DColwiseParallel(chunks=3)"
    assert type(plan.styles["transformer.ln_f"]).__name__ == "SequenceParallel"
    assert plan.styles["lm_head"].output_layouts == (Shard(-1),)
    bert = t.BertForMaskedLM(
        t.BertConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=4)
    )
    with pytest.raises(ValueError, match=r"BertForMaskedLM is none of these.*a BERT, for instance, is not laid out"):
        TensorParallelism(size=2, plan="auto+sequence").plan_for(bert)


def test_the_ledger_counts_the_collectives_of_the_split_layers_over_the_tensor_group_only():
    # in a forked child: torch's DTensor caches would keep this case's fake groups for the multi-process tests that
    # later fork from this process
    in_forked_child(_ledger_case, timeout=240)


def _ledger_case() -> None:
    # one process, torch's fake backend (a group of 4 ranks whose collectives talk to no one): tensor 2 x data 2
    import torch
    from torch.distributed._functional_collectives import all_reduce
    from torch.distributed.device_mesh import init_device_mesh

    from lightning_mgpu.ledger import CommStats
    from lightning_mgpu.planning.measure import fake_process_group
    from tests.tensor_parallel_models import Block

    with fake_process_group(4):
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("data_parallel", "tensor_parallel"))
        block = Block(8, n_heads=4, n_kv_heads=2, hidden=16).double()
        tp = TensorParallelism(size=2)
        tp.apply(block, mesh["tensor_parallel"])
        x = torch.randn(2, 6, 8, dtype=torch.float64, requires_grad=True)
        stats = CommStats()
        tp.count_into(stats, mesh["tensor_parallel"])
        with tp.counting():
            out = block(x)
            # forward: the row-wise wo and w2 all-reduce their outputs, 2 x 6 x 8 float64 = 768 bytes each
            assert (stats.tensor_calls, stats.tensor_bytes) == (2, 2 * 768)
            with tp.counting():  # nested: counted once
                out.sum().backward()
            # backward: the column-wise wq, wk, wv, w1, w3 all-reduce their input's gradient
            assert (stats.tensor_calls, stats.tensor_bytes, stats.tensor_sent_bytes) == (7, 7 * 768, 7 * 768.0)
            ones = torch.ones(3, dtype=torch.float64)
            float(all_reduce(ones, "sum", mesh["data_parallel"].get_group()).sum())  # another group: not counted
            float(all_reduce(ones, "sum", mesh["tensor_parallel"].get_group()).sum())  # this one: 24 bytes
        assert (stats.tensor_calls, stats.tensor_bytes) == (8, 7 * 768 + 24)
        block(x).sum().backward()  # outside the block: not counted
        assert stats.tensor_calls == 8
        stats.optimizer_steps = 2
        assert stats.tensor_sent_bytes_per_step == (7 * 768 + 24) / 2
        assert stats.as_metrics()["comm/tensor_calls_per_step"] == 4.0 and "tensor parallelism: 8" in stats.summary()
        assert "comm/tensor_bytes_per_step" not in CommStats().as_metrics()  # nothing counted: no such metric


def test_layers_wrapped_by_peft_lora_are_refused_before_any_collective():
    """No plan splits a layer wrapped by an adapter (the auto plan split none of a LoRA GPT-2's and replicated the
    whole model on every rank): a model that ``configure_model`` gave adapters is refused when the plan is applied,
    before the tensor group is used (``mesh`` is not touched); one rank, or the model without adapters, passes."""
    peft = pytest.importorskip("peft")
    model = TinyLlama()
    assert adapter_layers(model) == []
    peft.inject_adapter_in_model(peft.LoraConfig(r=2, target_modules=["wq", "w1"]), model)
    assert adapter_layers(model) == [f"layers.{i}.{n}" for i in range(2) for n in ("attention.wq", "feed_forward.w1")]
    with pytest.raises(
        ValueError, match=r"tensor_parallel_size=2 with adapters .* 'layers\.0\.attention\.wq'.*mgpu_zero3"
    ):
        TensorParallelism(2).apply(model, mesh=None)
    assert TensorParallelism(1).apply(model, mesh=None) is None


class _MLP(nn.Module):
    """An MLP with a norm (no weights of its own) after each hidden layer: the norm mixes the hidden units, so the
    structure gives no pair, and no name rule knows the layers."""

    def __init__(self) -> None:
        super().__init__()
        norms = [nn.LayerNorm(64, elementwise_affine=False) for _ in range(2)]
        self.net = nn.Sequential(
            nn.Linear(32, 64), norms[0], nn.ReLU(), nn.Linear(64, 64), norms[1], nn.ReLU(), nn.Linear(64, 4)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


def _pasted_plan(message: str) -> dict[str, str]:
    line = next(line for line in message.splitlines() if line.strip().startswith("tensor_parallel_plan={"))
    return ast.literal_eval(line.strip().removeprefix("tensor_parallel_plan="))


def test_a_model_the_auto_plan_splits_none_of_is_refused_naming_each_layer_and_a_plan_to_paste():
    """An MLP whose hidden layers are normalised: the auto plan pairs none of its layers (neither by name nor by its
    structure), so every rank of the tensor group would compute the whole model. The error names each linear layer and
    why it stays whole, and prints a plan that resolves against the model and splits most of it (a guess: the user
    checks the norm); that plan, or the explicit empty plan, is taken."""
    model = _MLP()
    with pytest.raises(ValueError) as refused:
        TensorParallelism(size=2).plan_for(model)
    message = str(refused.value)
    assert (
        "tensor_parallel_size=2 with tensor_parallel_plan='auto': the auto plan splits 0 layers of _MLP, 0%" in message
    )
    for layer in ("net.0 (Linear 32 -> 64)", "net.3 (Linear 64 -> 64)", "net.6 (Linear 64 -> 4)"):
        assert f"  - {layer}: neither a name rule (wq/wo, " in message
    assert "nor the model's structure pairs it" in message
    assert "pass the explicit empty plan tensor_parallel_plan={}" in message
    pasted = _pasted_plan(message)
    assert pasted == {"net.0": "colwise", "net.3": "rowwise"}
    plan = plan_from_patterns(model, pasted, "your plan")
    assert plan.kinds() == {"net.0": "colwise", "net.3": "rowwise"}
    split, total = split_share(model, plan)
    assert split >= total / 2
    assert TensorParallelism(size=2, plan=pasted).plan_for(model).share == split / total
    assert TensorParallelism(size=2, plan={}).plan_for(model).styles == {}  # the user's choice: nothing split


def test_a_refusal_says_when_a_norm_sits_between_or_the_heads_do_not_divide_and_pastes_layer_patterns():
    class Normed(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc1, self.norm, self.fc2 = nn.Linear(8, 16), nn.LayerNorm(16), nn.Linear(16, 8)

    with pytest.raises(ValueError, match=r"fc1 \(Linear 8 -> 16\): Normed holds other layers beside it \(fc2, norm\)"):
        TensorParallelism(size=2).plan_for(Normed())
    # at 4 ranks the attention stays whole (2 key/value heads), and it holds 80% of the linear parameters
    model = nn.Module()
    model.layers = nn.ModuleList(Block(16, n_heads=4, n_kv_heads=2, hidden=4) for _ in range(2))
    with pytest.raises(ValueError) as refused:
        TensorParallelism(size=4).plan_for(model)
    message = str(refused.value)
    assert "the auto plan splits 6 layers of Module, 20% of its linear layers' parameters" in message
    assert (
        "layers.*.attention.wk (Linear 16 -> 8) x2: its block layers.*.attention stays whole: n_kv_heads=2" in message
    )
    # the layers it splits, as patterns; the attention it cannot split at this size is left out of the guess
    pasted = _pasted_plan(message)
    assert pasted == {"layers.*.feed_forward.w1": "colwise", "layers.*.feed_forward.w3": "colwise",
                      "layers.*.feed_forward.w2": "rowwise"}  # fmt: skip
    assert len(plan_from_patterns(model, pasted, "your plan").styles) == 6


def test_the_start_up_line_says_the_share_of_the_linear_layers_parameters_split():
    """The head (as wide as the vocabulary) is not counted: a Llama-style model is split whole."""
    plan = TensorParallelism(size=2).plan_for(TinyLlama(layers=2))
    assert plan.summary(2).startswith(
        "tensor parallelism over 2 ranks (auto plan): split 14 layers, 100% of the linear layers' parameters ("
    )
    # its MLP split (the row-wise bias whole), the attention's output projection whole: 1,056 of 1,344
    layer = nn.TransformerEncoderLayer(16, 4, 32)
    assert ", 79% of the linear layers' parameters (" in TensorParallelism(size=2).plan_for(layer).summary(2)
