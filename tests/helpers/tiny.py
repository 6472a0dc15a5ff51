"""Tiny random checkpoints built in the tests (vocab ~300, 2 layers), written as real
Hugging Face directories by transformers so that readers and decoders are checked
against the reference implementation."""

from __future__ import annotations

import json
import os

import torch

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def byte_level_tokenizer_json(extra_merges: int = 40) -> str:
    """A byte-level BPE tokenizer: 3 specials, 256 byte symbols, a few merges of common pairs."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from tokenizers.pre_tokenizers import ByteLevel

    alphabet = ByteLevel.alphabet()
    alphabet.sort()
    vocab = {s: i for i, s in enumerate(SPECIALS)}
    for ch in alphabet:
        vocab[ch] = len(vocab)
    merges = []
    pairs = [("t", "h"), ("th", "e"), ("Ġ", "t"), ("i", "n"), ("a", "n"), ("e", "r"), ("Ġ", "a"),
             ("o", "n"), ("r", "e"), ("h", "e"), ("Ġt", "he"), ("e", "s"), ("o", "r"), ("Ġ", "s"), ("e", "n"),
             ("a", "t"), ("Ġ", "w"), ("Ġ", "c"), ("i", "s"), ("Ġ", "o"), ("l", "l")]
    for a, b in pairs[:extra_merges]:
        if a + b not in vocab:
            vocab[a + b] = len(vocab)
            merges.append((a, b))
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(SPECIALS)
    return tok.to_str()


CHAT_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] "
    "+ '<|im_end|>' + '\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def make_tiny_hf(path: str, arch: str = "llama", vocab: int = 320, hidden: int = 64, layers: int = 2,
                 heads: int = 4, kv_heads: int = 2, inter: int = 128, tie: bool = False, seed: int = 0,
                 dtype: torch.dtype = torch.float32, rope_scaling: dict | None = None,
                 scale: float = 1.0, head_dim: int | None = None) -> str:
    """Write a random HF checkpoint directory at `path` and return it.

    `scale` multiplies the random weights so that tiny models give peaked (not uniform)
    distributions, which speculation tests need for acceptance to happen. `head_dim` sets the
    attention head size apart from hidden // heads (the default, 16 here, has no TensorRT-LLM
    kernel: tests of engine configs that must be valid on a GPU pass 32 or 64).
    """
    import transformers

    torch.manual_seed(seed)
    common = dict(vocab_size=vocab, hidden_size=hidden, num_hidden_layers=layers,
                  num_attention_heads=heads, num_key_value_heads=kv_heads, intermediate_size=inter,
                  max_position_embeddings=512, tie_word_embeddings=tie, rms_norm_eps=1e-6,
                  bos_token_id=0, eos_token_id=0)
    if head_dim is not None:
        common["head_dim"] = head_dim
    if arch == "llama":
        cfg = transformers.LlamaConfig(rope_theta=10000.0, rope_scaling=rope_scaling, **common)
        model = transformers.LlamaForCausalLM(cfg)
    elif arch == "qwen2":
        cfg = transformers.Qwen2Config(rope_theta=10000.0, **common)
        model = transformers.Qwen2ForCausalLM(cfg)
    else:
        raise ValueError(arch)
    if scale != 1.0:
        with torch.no_grad():
            for name, p in model.named_parameters():
                if p.dim() == 2:
                    p.mul_(scale)
    model = model.to(dtype)
    os.makedirs(path, exist_ok=True)
    model.save_pretrained(path, safe_serialization=True)
    with open(os.path.join(path, "tokenizer.json"), "w") as f:
        f.write(byte_level_tokenizer_json())
    with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
        json.dump({"eos_token": "<|im_end|>", "bos_token": None, "chat_template": CHAT_TEMPLATE}, f)
    return path


def hf_logits(path: str, input_ids: list[int], dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """transformers' own logits for input_ids: [T, vocab]."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    model.eval()
    with torch.no_grad():
        return model(torch.tensor([input_ids])).logits[0].float()


def perturbed_copy(src: str, dst: str, noise: float, seed: int = 1) -> str:
    """A draft that is the target plus Gaussian noise: accepted often, not always."""
    from safetensors.torch import load_file, save_file
    import shutil

    shutil.copytree(src, dst)
    path = os.path.join(dst, "model.safetensors")
    tensors = load_file(path)
    gen = torch.Generator().manual_seed(seed)
    for name, t in tensors.items():
        if t.dim() == 2:
            tensors[name] = t + noise * t.std() * torch.randn(t.shape, generator=gen, dtype=t.dtype)
    save_file(tensors, path, metadata={"format": "pt"})
    return dst



def draft_pair_bundle(root, noise: float = 0.08, **options) -> str:
    """The drafter tests' standard bundle: a tiny random Llama target (scale 4, seed 3) and a
    draft that is that target plus `noise` (perturbed_copy), compiled in float64 (`options`:
    more CompileOptions fields) under `root`/bundle."""
    from specbuild.compiler.compile import CompileOptions, compile_bundle

    root = str(root)
    target = make_tiny_hf(os.path.join(root, "target"), scale=4.0, seed=3)
    draft = perturbed_copy(target, os.path.join(root, "draft"), noise=noise)
    return compile_bundle(target, os.path.join(root, "bundle"), CompileOptions(dtype="float64", **options), draft=draft)


# prompts for the draft-pair bundle's speculation runs: a repeat (prompt lookup finds it), a short
# one, and one long enough to cross blocks and chunks
SPEC_PROMPTS = [[5, 6, 7, 8, 9, 10, 11, 5, 6, 7, 8], [20, 21], list(range(30, 90)) + list(range(30, 40))]


def spec_run(engine, method, gamma=None, prompts=SPEC_PROMPTS, max_tokens=40, **sampling):
    """engine.generate over `prompts` with speculation `method` (and `gamma`), ignore_eos."""
    from specbuild.engine.sequence import Request
    from specbuild.sampling.params import SamplingParams
    from specbuild.speculation.config import SpeculationConfig

    spec = SpeculationConfig.make(None, method=method, gamma=gamma)
    reqs = [Request(prompt_ids=p, speculation=spec,
                    sampling=SamplingParams(max_tokens=max_tokens, ignore_eos=True, **sampling)) for p in prompts]
    return engine.generate(reqs)


def rows_cost_nothing(engine) -> None:
    """Price every forward row at nothing in the batch's fit (Speculator.step_line), so the fit
    keeps every node a drafter offers. For tests of a drafter's drafts and their verification:
    the fit prices rows by the wall time of the steps run so far (speculation/goodput.RowPrice),
    and on a tiny model, whose steps are mostly Python, that line is noise. A run where it came
    out steep cut suffix's drafts to a node every 16 steps, and none of those 18 was accepted.
    The fit itself is tested with given costs (tests/speculation/test_batch_fit.py)."""
    engine.speculator.step_line = lambda batch, lo, hi: (1.0, 0.0)


def check_drafters_equal_plain(engine, gammas, methods=("ngram", "draft")) -> None:
    """Greedy output of each method at each gamma equals plain decoding's, drafts are proposed
    and some accepted (a fixed gamma of the draft model: more than 1.2 tokens a pass on some
    prompt), and every KV block comes back, the target's and the draft model's."""
    import itertools

    plain = spec_run(engine, "none")
    assert all(r["stats"]["drafted"] == 0 for r in plain)
    for method, gamma in itertools.product(methods, gammas):
        spec = spec_run(engine, method, gamma)
        for r, p in zip(spec, plain):
            assert r["token_ids"] == p["token_ids"], (method, gamma)
        drafted = sum(r["stats"]["drafted"] for r in spec)
        accepted = sum(r["stats"]["accepted"] for r in spec)
        assert drafted > 0 and accepted > 0, (method, gamma, drafted, accepted)
        if gamma is not None and method == "draft":
            assert max(r["stats"]["mean_accepted_tokens"] for r in spec) > 1.2
    assert engine.cache.free_blocks == engine.cache.num_blocks
    assert engine.speculator.proposers["draft"].cache.free_blocks == engine.speculator.proposers["draft"].cache.num_blocks


def make_tiny_eagle3(path: str, target: str, draft_vocab: int = 100, seed: int = 5) -> str:
    """A random EAGLE-3 head (formats/eagle3.py's layout) for the HF target directory `target`:
    one layer of the target's shape, fc over three target layers, draft vocabulary the first
    `draft_vocab` target ids (d2t zeros)."""
    from specbuild.formats import eagle3

    cfg = json.load(open(os.path.join(target, "config.json")))
    h, heads, kv = cfg["hidden_size"], cfg["num_attention_heads"], cfg.get("num_key_value_heads", cfg["num_attention_heads"])
    d, inter = cfg.get("head_dim") or h // heads, cfg["intermediate_size"]
    gen = torch.Generator().manual_seed(seed)

    def w(*shape):
        return 0.05 * torch.randn(shape, generator=gen)

    tensors = {"fc.weight": w(h, 3 * h), "norm.weight": torch.ones(h), "lm_head.weight": w(draft_vocab, h),
               "d2t": torch.zeros(draft_vocab, dtype=torch.int64),
               "midlayer.hidden_norm.weight": torch.ones(h), "midlayer.input_layernorm.weight": torch.ones(h),
               "midlayer.post_attention_layernorm.weight": torch.ones(h),
               "midlayer.self_attn.q_proj.weight": w(heads * d, 2 * h), "midlayer.self_attn.k_proj.weight": w(kv * d, 2 * h),
               "midlayer.self_attn.v_proj.weight": w(kv * d, 2 * h), "midlayer.self_attn.o_proj.weight": w(h, heads * d),
               "midlayer.mlp.gate_proj.weight": w(inter, h), "midlayer.mlp.up_proj.weight": w(inter, h),
               "midlayer.mlp.down_proj.weight": w(h, inter)}
    config = {"architectures": [eagle3.ARCHITECTURE], "model_type": "llama", "hidden_size": h,
              "intermediate_size": inter, "num_attention_heads": heads, "num_key_value_heads": kv, "head_dim": d,
              "num_hidden_layers": 1, "rms_norm_eps": cfg.get("rms_norm_eps", 1e-5),
              "rope_theta": cfg.get("rope_theta", 10000.0), "max_position_embeddings": cfg["max_position_embeddings"],
              "hidden_act": "silu", "vocab_size": cfg["vocab_size"], "draft_vocab_size": draft_vocab,
              "target_hidden_size": h, "tie_word_embeddings": False, "torch_dtype": "float32"}
    eagle3.write_eagle3(path, config, tensors)
    return path


def trtllm_draft_bundle(root, **hf_fields) -> str:
    """A tiny draft/target bundle (the target drafting for itself) with a TensorRT-LLM part in
    bfloat16, as the LLM-API tests' stand-in serves it; `hf_fields`: make_tiny_hf's shape."""
    from specbuild.compiler.compile import CompileOptions, compile_bundle

    root = str(root)
    target = make_tiny_hf(os.path.join(root, "target"), **{"scale": 8.0, "head_dim": 32, **hf_fields})
    opts = CompileOptions(dtype="float64", max_seq_len=128, max_batch_size=4, max_draft_len=4,
                          backend="tensorrt-llm", trtllm_dtype="bfloat16")
    return compile_bundle(target, os.path.join(root, "bundle"), opts, draft=target)
