"""TensorRT-LLM checkpoints: the writer against the reference §1 table (expected tensors are
computed here from the HF weights by index arithmetic, independently of the writer), and
the inverse reader back into specbuild's decoder against transformers' logits."""

from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors.torch import load_file
from tiny import hf_logits, make_tiny_hf

from specbuild.formats.checkpoints import Checkpoint, read_hf_dir, to_runtime_layout
from specbuild.formats.trtllm_checkpoint import pp_layer_ranges, rank_position, read_trtllm_checkpoint, read_trtllm_medusa, valid_tp_sizes, write_trtllm_checkpoint
from specbuild.bundle import ModelConfig
from specbuild.errors import CheckpointError
from specbuild.model.decoder import reference_forward

VOCAB = 301  # divisible by neither 2 nor 4: lm_head padding at tp 2 and 4
LAYERS = 4  # pp 2 splits it evenly, as every pinned TensorRT-LLM release needs (issue 17 row 9)
INPUT_IDS = [5, 17, 120, 3, 250, 9, 88, 300, 41, 7, 64, 199]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf")
    common = dict(vocab=VOCAB, hidden=64, layers=LAYERS, heads=4, kv_heads=2, inter=128)
    return {
        "llama": make_tiny_hf(str(root / "llama"), arch="llama", seed=1, **common),
        "qwen2": make_tiny_hf(str(root / "qwen2"), arch="qwen2", tie=True, seed=2, **common),
    }


def fasterdecoding_heads(hidden: int, vocab: int, num_heads: int = 2, num_layers: int = 1, seed: int = 3):
    gen = torch.Generator().manual_seed(seed)
    heads = {}
    for h in range(num_heads):
        for l in range(num_layers):
            heads[f"{h}.{l}.linear.weight"] = torch.randn(hidden, hidden, generator=gen)
            heads[f"{h}.{l}.linear.bias"] = torch.randn(hidden, generator=gen)
        heads[f"{h}.{num_layers}.weight"] = torch.randn(vocab, hidden, generator=gen)
    return heads


def expected_rank(sd: dict, cfg: dict, tp: int, pp: int, rank: int, medusa: dict | None = None) -> dict:
    """The reference §1 table, by explicit row/column ranges (no chunk, no repeat)."""
    heads, kv, d = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    vocab, hidden, inter = cfg["vocab_size"], cfg["hidden_size"], cfg["intermediate_size"]
    tp_rank, pp_rank = rank % tp, rank // tp
    base, extra = divmod(cfg["num_hidden_layers"], pp)
    sizes = [base + (1 if s < extra else 0) for s in range(pp)]
    start = sum(sizes[:pp_rank])

    def rows(t, n, r=tp_rank):
        return t[r * n:(r + 1) * n]

    def kv_rows(t):
        if kv >= tp:
            return rows(t, kv * d // tp)
        head = tp_rank // (tp // kv)  # adjacent copies: ranks 0..reps-1 share head 0, ...
        return t[head * d:(head + 1) * d]

    exp = {}
    if pp_rank == 0:
        exp["transformer.vocab_embedding.weight"] = sd["model.embed_tokens.weight"]
    for local in range(sizes[pp_rank]):
        a, m, o = f"model.layers.{start + local}.self_attn.", f"model.layers.{start + local}.mlp.", f"transformer.layers.{local}."
        exp[o + "attention.qkv.weight"] = torch.cat(
            [rows(sd[a + "q_proj.weight"], heads * d // tp), kv_rows(sd[a + "k_proj.weight"]), kv_rows(sd[a + "v_proj.weight"])])
        if a + "q_proj.bias" in sd:
            exp[o + "attention.qkv.bias"] = torch.cat(
                [rows(sd[a + "q_proj.bias"], heads * d // tp), kv_rows(sd[a + "k_proj.bias"]), kv_rows(sd[a + "v_proj.bias"])])
        cols = heads * d // tp
        exp[o + "attention.dense.weight"] = sd[a + "o_proj.weight"][:, tp_rank * cols:(tp_rank + 1) * cols]
        exp[o + "input_layernorm.weight"] = sd[f"model.layers.{start + local}.input_layernorm.weight"]
        exp[o + "post_layernorm.weight"] = sd[f"model.layers.{start + local}.post_attention_layernorm.weight"]
        exp[o + "mlp.fc.weight"] = rows(sd[m + "gate_proj.weight"], inter // tp)
        exp[o + "mlp.gate.weight"] = rows(sd[m + "up_proj.weight"], inter // tp)
        exp[o + "mlp.proj.weight"] = sd[m + "down_proj.weight"][:, tp_rank * inter // tp:(tp_rank + 1) * inter // tp]
    vocab_padded = -(-vocab // tp) * tp

    def padded_rows(t):
        full = torch.zeros(vocab_padded, hidden, dtype=t.dtype)
        full[:vocab] = t
        return rows(full, vocab_padded // tp)

    if pp_rank == pp - 1:
        exp["transformer.ln_f.weight"] = sd["model.norm.weight"]
        exp["lm_head.weight"] = padded_rows(sd.get("lm_head.weight", sd["model.embed_tokens.weight"]))
    if medusa is not None:
        for h in range(2):
            p = f"medusa_heads.{h}."
            exp[p + "medusa_layers.0.linear.weight"] = rows(medusa[f"{h}.0.linear.weight"], hidden // tp)
            exp[p + "medusa_layers.0.linear.bias"] = rows(medusa[f"{h}.0.linear.bias"], hidden // tp)
            exp[p + "lm_head.weight"] = padded_rows(medusa[f"{h}.1.weight"])
    return exp


def hf_state(path: str) -> tuple[dict, dict]:
    with open(os.path.join(path, "config.json")) as f:
        cfg = json.load(f)
    cfg.setdefault("head_dim", cfg["hidden_size"] // cfg["num_attention_heads"])
    sd = load_file(os.path.join(path, "model.safetensors"))
    if cfg.get("tie_word_embeddings"):
        sd.pop("lm_head.weight", None)
    return sd, cfg


CASES = [("llama", 1, 1), ("llama", 2, 1), ("llama", 4, 1), ("llama", 1, 2), ("llama", 2, 2),
         ("qwen2", 1, 1), ("qwen2", 4, 1), ("qwen2", 2, 2)]


@pytest.mark.parametrize("arch,tp,pp", CASES)
def test_rank_files_match_reference_table(models, tmp_path, arch, tp, pp):
    sd, cfg = hf_state(models[arch])
    medusa = fasterdecoding_heads(cfg["hidden_size"], VOCAB) if arch == "llama" and pp == 1 else None  # tp only
    dtype = torch.float16 if (tp, pp) == (2, 2) else torch.float32
    out = str(tmp_path / "ckpt")
    write_trtllm_checkpoint(read_hf_dir(models[arch]), out, dtype=str(dtype).split(".")[1], tp=tp, pp=pp,
                            medusa=medusa, max_draft_len=5)
    assert sorted(os.listdir(out)) == sorted(["config.json"] + [f"rank{r}.safetensors" for r in range(tp * pp)])
    for rank in range(tp * pp):
        actual = load_file(os.path.join(out, f"rank{rank}.safetensors"))
        expected = expected_rank(sd, cfg, tp, pp, rank, medusa)
        assert sorted(actual) == sorted(expected), f"rank {rank}"
        for name, t in expected.items():
            assert actual[name].dtype == dtype, name
            assert torch.equal(actual[name], t.to(dtype)), f"rank {rank}: {name}"
    if tp == 4:  # 2 KV heads at tp 4: ranks 0,1 carry KV head 0 and ranks 2,3 KV head 1
        r0, r1 = (load_file(os.path.join(out, f"rank{r}.safetensors")) for r in (0, 1))
        kv0 = r0["transformer.layers.0.attention.qkv.weight"][16:]
        assert torch.equal(kv0, r1["transformer.layers.0.attention.qkv.weight"][16:])
        assert (r0["lm_head.weight"].shape[0], r1["lm_head.weight"].shape[0]) == (76, 76)  # 304 / 4


def test_config_json(models, tmp_path):
    ckpt = read_hf_dir(models["llama"])
    heads = fasterdecoding_heads(64, VOCAB)
    cfg = write_trtllm_checkpoint(ckpt, str(tmp_path / "m"), dtype="bfloat16", tp=2, pp=1, medusa=heads, max_draft_len=7)
    with open(tmp_path / "m" / "config.json") as f:
        assert json.load(f) == cfg
    assert cfg["architecture"] == "MedusaForCausalLM" and cfg["model_type"] == "llama"
    assert (cfg["num_medusa_heads"], cfg["num_medusa_layers"], cfg["max_draft_len"]) == (2, 1, 7)
    # only keys every release's Mapping takes (older ones have no cp_size): issue 17 row 9
    assert cfg["mapping"] == {"world_size": 2, "tp_size": 2, "pp_size": 1, "gpus_per_node": 8}
    assert (cfg["dtype"], cfg["logits_dtype"], cfg["hidden_act"], cfg["position_embedding_type"]) == (
        "bfloat16", "float32", "silu", "rope_gpt_neox")
    assert (cfg["vocab_size"], cfg["num_key_value_heads"], cfg["head_size"], cfg["intermediate_size"]) == (VOCAB, 2, 16, 128)
    assert cfg["quantization"] == {"quant_algo": None, "kv_cache_quant_algo": None} and "specbuild" not in cfg
    qwen = write_trtllm_checkpoint(read_hf_dir(models["qwen2"]), str(tmp_path / "q"), dtype="float16")
    assert (qwen["architecture"], qwen["qwen_type"], qwen["attn_bias"], qwen["tie_word_embeddings"]) == (
        "Qwen2ForCausalLM", "qwen2", True, True)
    qm = write_trtllm_checkpoint(read_hf_dir(models["qwen2"]), str(tmp_path / "qm"), dtype="float32", medusa=heads)
    assert (qm["architecture"], qm["model_type"], qm["qwen_type"], qm["max_draft_len"]) == (
        "MedusaForCausalLM", "qwen2", "qwen2", 63)  # TensorRT-LLM's default budget
    assert read_trtllm_checkpoint(str(tmp_path / "qm")).config == read_hf_dir(models["qwen2"]).config


@pytest.mark.parametrize("arch,tp,pp", [(a, tp, pp) for a in ("llama", "qwen2")
                                        for tp, pp in ((1, 1), (2, 1), (4, 1), (1, 2), (2, 2))])
def test_inverse_reader_logits_equal_transformers(models, tmp_path, arch, tp, pp):
    original = read_hf_dir(models[arch])
    out = str(tmp_path / "ckpt")
    write_trtllm_checkpoint(original, out, dtype="float32", tp=tp, pp=pp)
    back = read_trtllm_checkpoint(out, tokenizer_json=original.tokenizer_json)
    assert back.config == original.config
    assert sorted(back.tensors) == sorted(original.tensors)
    assert all(torch.equal(back.tensors[n], original.tensors[n]) for n in original.tensors)
    logits = reference_forward(back.config, to_runtime_layout(back), torch.tensor(INPUT_IDS))
    expected = hf_logits(models[arch], INPUT_IDS)
    assert logits.shape == (len(INPUT_IDS), VOCAB)
    assert (logits - expected).abs().max().item() <= 1e-5


def test_mlp_padded_when_tp_does_not_divide_intermediate(tmp_path):
    # 3 heads, 1 KV head (duplicated 3x), intermediate 100 -> 102 at tp 3
    path = make_tiny_hf(str(tmp_path / "hf"), vocab=VOCAB, hidden=48, layers=2, heads=3, kv_heads=1, inter=100, seed=4)
    original = read_hf_dir(path)
    out = str(tmp_path / "ckpt")
    cfg = write_trtllm_checkpoint(original, out, dtype="float32", tp=3, pp=2)
    assert cfg["intermediate_size"] == 102 and cfg["specbuild"] == {"intermediate_size": 100}
    last = load_file(os.path.join(out, "rank2.safetensors"))  # tp_rank 2 of stage 0
    fc = last["transformer.layers.0.mlp.fc.weight"]
    assert fc.shape == (34, 48) and torch.equal(fc[32:], torch.zeros(2, 48))
    assert torch.equal(last["transformer.layers.0.mlp.proj.weight"][:, 32:], torch.zeros(48, 2))
    assert torch.equal(fc[:32], original.tensors["model.layers.0.mlp.gate_proj.weight"][68:])
    back = read_trtllm_checkpoint(out)
    assert back.config == original.config
    logits = reference_forward(back.config, to_runtime_layout(back), torch.tensor(INPUT_IDS))
    assert (logits - hf_logits(path, INPUT_IDS)).abs().max().item() <= 1e-5


def test_medusa_heads_round_trip(models, tmp_path):
    ckpt = read_hf_dir(models["llama"])
    heads = fasterdecoding_heads(64, VOCAB, num_heads=3, num_layers=2)
    write_trtllm_checkpoint(ckpt, str(tmp_path / "a"), dtype="float32", tp=4, pp=1, medusa=heads)
    back = read_trtllm_medusa(str(tmp_path / "a"))
    assert sorted(back) == sorted(heads) and all(torch.equal(back[n], heads[n]) for n in heads)
    for rank in range(4):  # on every rank
        names = load_file(str(tmp_path / "a" / f"rank{rank}.safetensors"))
        assert "medusa_heads.2.medusa_layers.1.linear.bias" in names
    # TensorRT-LLM names in, a head without its own lm_head shares the target's
    trt_named = {f"medusa_heads.{n.split('.')[0]}.medusa_layers.{n.split('.')[1]}.linear.{n.split('.')[-1]}": t
                 for n, t in heads.items() if ".linear." in n}
    trt_named["medusa_heads.0.lm_head.weight"] = heads["0.2.weight"]
    write_trtllm_checkpoint(ckpt, str(tmp_path / "b"), dtype="float32", tp=2, medusa=trt_named)
    back = read_trtllm_medusa(str(tmp_path / "b"))
    assert torch.equal(back["0.2.weight"], heads["0.2.weight"])
    assert torch.equal(back["1.2.weight"], ckpt.tensors["lm_head.weight"])
    assert read_trtllm_medusa(str(tmp_path / "b")) is not None
    write_trtllm_checkpoint(ckpt, str(tmp_path / "c"), dtype="float32")
    assert read_trtllm_medusa(str(tmp_path / "c")) is None


def smol_like(**over) -> ModelConfig:
    base = dict(architecture="llama", vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30,
                num_heads=9, num_kv_heads=3, head_dim=64, tie_word_embeddings=True)
    return ModelConfig(**{**base, **over})


def test_invalid_tp_lists_valid_values():
    smol = smol_like()  # SmolLM2-135M: 9 heads, 3 KV heads
    assert valid_tp_sizes(smol) == [1, 3, 9]
    with pytest.raises(ValueError, match=r"tp=2 .*valid tp sizes: 1, 3, 9"):
        write_trtllm_checkpoint(Checkpoint(smol, {}, ""), "/nonexistent/never-written", tp=2)
    assert valid_tp_sizes(smol_like(num_heads=12, num_kv_heads=6)) == [1, 2, 3, 6, 12]  # tp 4: 6 % 4, 4 % 6
    gqa = smol_like(num_heads=4, num_kv_heads=2, hidden_size=66, head_dim=16)
    assert valid_tp_sizes(gqa) == [1, 2, 4] and valid_tp_sizes(gqa, medusa=True) == [1, 2]
    with pytest.raises(ValueError, match=r"pp=31 must be in \[1, 30\]"):
        write_trtllm_checkpoint(Checkpoint(smol, {}, ""), "/nonexistent/never-written", tp=3, pp=31)
    with pytest.raises(ValueError, match="dtype 'int8'"):
        write_trtllm_checkpoint(Checkpoint(smol, {}, ""), "/nonexistent/never-written", dtype="int8")
    assert not os.path.exists("/nonexistent/never-written")


def test_rank_mapping_matches_tensorrt_llm():
    # tensorrt_llm/mapping.py docstring: tp 4, pp 2 -> tp groups [0..3], [4..7]; pp groups [0, 4], ...
    assert [rank_position(r, 4) for r in (0, 3, 4, 5, 7)] == [(0, 0), (3, 0), (0, 1), (1, 1), (3, 1)]
    assert pp_layer_ranges(3, 2) == [range(0, 2), range(2, 3)]  # first L % pp stages get one more
    assert pp_layer_ranges(30, 2) == [range(0, 15), range(15, 30)]
    assert pp_layer_ranges(7, 3) == [range(0, 3), range(3, 5), range(5, 7)]


def test_reader_refuses_incomplete_checkpoint(models, tmp_path):
    out = tmp_path / "ckpt"
    write_trtllm_checkpoint(read_hf_dir(models["llama"]), str(out), dtype="float32", tp=2)
    os.remove(out / "rank1.safetensors")
    with pytest.raises(CheckpointError, match="rank1.safetensors is missing"):
        read_trtllm_checkpoint(str(out))
    with pytest.raises(CheckpointError, match="no config.json"):
        read_trtllm_checkpoint(str(tmp_path))


def test_pipeline_layouts_every_pinned_release_reads(models, tmp_path):
    """Issue 17 rows 6 and 9: Medusa is tp only; pp must divide the layers (releases whose
    Mapping.pp_layers is layers // pp would drop the remainder)."""
    ckpt = read_hf_dir(models["llama"])
    with pytest.raises(ValueError, match=r"pp=2: Medusa on TensorRT-LLM is tensor parallel only"):
        write_trtllm_checkpoint(ckpt, str(tmp_path / "m"), tp=2, pp=2, medusa=fasterdecoding_heads(64, VOCAB))
    smol = smol_like()  # 30 layers
    with pytest.raises(ValueError, match=r"pp=4 does not divide the model's 30 layers .* valid pp sizes: 1, 2, 3, 5, "
                                         r"6, 10, 15, 30"):
        write_trtllm_checkpoint(Checkpoint(smol, {}, ""), str(tmp_path / "never"), tp=3, pp=4)
    assert not (tmp_path / "m").exists() and not (tmp_path / "never").exists()
