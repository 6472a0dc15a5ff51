"""The `specbuild` command as a user runs it (a subprocess): bad input gives one error line
naming the value and the limit, a non-zero exit and no traceback; `generate --json` and
`inspect --json` print the documented shapes; `--seed S` gives prompt i the seed S + i."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest
from tokenizers import Tokenizer

from specbuild.bundle import SCHEMA_VERSION

BIN = os.path.join(os.path.dirname(sys.executable), "specbuild")
COMMAND = [BIN] if os.path.isfile(BIN) else [sys.executable, "-c", "from specbuild.cli import main; main()"]
MAX_SEQ_LEN = 32
STATS_KEYS = {"seed", "prompt_tokens", "generated_tokens", "target_passes", "ttft_ms", "tpot_ms", "tokens_per_s"}


def specbuild(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([*COMMAND, *args], capture_output=True, text=True, timeout=180)


def assert_user_error(proc: subprocess.CompletedProcess, *needles: str) -> str:
    """Non-zero exit, no traceback, exactly one `error:` line, last, naming every needle."""
    assert proc.returncode != 0, proc.stdout
    assert "Traceback" not in proc.stderr, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith("error:")]
    assert len(errors) == 1 and lines[-1] == errors[0], proc.stderr
    for needle in needles:
        assert needle in errors[0], f"{needle!r} not in {errors[0]!r}"
    return errors[0]


@pytest.fixture(scope="module")
def cli_bundle(tiny_hf_dir, tmp_path_factory) -> str:
    """The tiny checkpoint compiled by the CLI itself, with a 32-token context."""
    out = str(tmp_path_factory.mktemp("cli") / "bundle")
    proc = specbuild("compile", "--target", tiny_hf_dir, "--out", out, "--max-seq-len", str(MAX_SEQ_LEN))
    assert proc.returncode == 0, proc.stderr
    assert "bundle written to" in proc.stderr
    return out


# ---- bad input ------------------------------------------------------------------------------
# Every case is a separate process; they start together (each spends ~2 s importing torch).

def write_truncated_gguf(path: str) -> None:
    """A well-formed little Llama GGUF whose tensor data is cut off (a broken download)."""
    import gguf
    import numpy as np

    writer = gguf.GGUFWriter(path, "llama")
    writer.add_block_count(2)
    writer.add_embedding_length(64)
    writer.add_head_count(4)
    writer.add_feed_forward_length(128)
    writer.add_tensor("token_embd.weight", np.ones((320, 64), dtype=np.float32))
    writer.add_tensor("output_norm.weight", np.ones((64,), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with open(path, "rb") as f:
        data = f.read()
    with open(path, "wb") as f:
        f.write(data[:len(data) - 40000])


def write_bad_inputs(root: str, tiny_hf_dir: str, cli_bundle: str) -> dict:
    """name -> (argv, needles the one error line must contain)."""
    gpt2 = os.path.join(root, "gpt2")
    os.makedirs(gpt2)
    with open(os.path.join(gpt2, "config.json"), "w") as f:
        json.dump({"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"], "vocab_size": 50257}, f)
    corrupt = os.path.join(root, "corrupt")
    shutil.copytree(tiny_hf_dir, corrupt)
    weights = os.path.join(corrupt, "model.safetensors")
    with open(weights, "rb") as f:
        head = f.read(4096)  # header intact, data cut off
    with open(weights, "wb") as f:
        f.write(head)
    garbage = os.path.join(root, "garbage.gguf")
    with open(garbage, "wb") as f:
        f.write(b"GGUF\x03\x00\x00\x00" + b"\x17" * 64)
    truncated = os.path.join(root, "truncated.gguf")
    write_truncated_gguf(truncated)
    future = os.path.join(root, "future")
    shutil.copytree(cli_bundle, future)
    with open(os.path.join(future, "bundle.json")) as f:
        meta = json.load(f)
    meta["schema_version"] = SCHEMA_VERSION + 1
    with open(os.path.join(future, "bundle.json"), "w") as f:
        json.dump(meta, f)
    out = os.path.join(root, "out")
    missing = os.path.join(root, "no-such-model")
    return {
        "missing checkpoint": (["compile", "--target", missing, "--out", out], (missing, "does not exist")),
        "unknown preset": (["compile", "--target", "smollm9-7b", "--out", out], ("smollm9-7b", "smollm2-135m")),
        "unsupported architecture": (["compile", "--target", gpt2, "--out", out], ("'gpt2'", "supported: llama")),
        "corrupt safetensors": (["compile", "--target", corrupt, "--out", out], (weights, "safetensors")),
        "garbage gguf": (["compile", "--target", garbage, "--out", out], (garbage, "GGUF")),
        "truncated gguf": (["compile", "--target", truncated, "--out", out], (truncated, "GGUF")),
        "newer schema": (["generate", future, "--prompt", "hi"],
                         (f"schema_version {SCHEMA_VERSION + 1}", f"({SCHEMA_VERSION})")),
        "prompt too long": (["generate", cli_bundle, "--prompt", "hello world " * 20],
                            ("max_seq_len is 32", "prompt is ")),
        "temperature": (["generate", cli_bundle, "--prompt", "hi", "--temperature", "-1"],
                        ("temperature=-1.0", "[0, 100]")),
        "top-p": (["generate", cli_bundle, "--prompt", "hi", "--top-p", "0"], ("top_p=0.0", "(0, 1]")),
    }


BAD_INPUTS = ["missing checkpoint", "unknown preset", "unsupported architecture", "corrupt safetensors",
              "garbage gguf", "truncated gguf", "newer schema", "prompt too long", "temperature", "top-p"]


@pytest.fixture(scope="module")
def bad_input_runs(tiny_hf_dir, cli_bundle, tmp_path_factory) -> dict:
    """name -> (CompletedProcess, needles), all processes run concurrently."""
    root = str(tmp_path_factory.mktemp("bad_inputs"))
    cases = write_bad_inputs(root, tiny_hf_dir, cli_bundle)
    assert sorted(cases) == sorted(BAD_INPUTS)
    procs = {name: subprocess.Popen([*COMMAND, *argv], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for name, (argv, _) in cases.items()}
    runs = {}
    for name, (argv, needles) in cases.items():
        p = procs[name]
        stdout, stderr = p.communicate(timeout=180)
        runs[name] = (subprocess.CompletedProcess(p.args, p.returncode, stdout, stderr), needles)
    assert not os.path.exists(os.path.join(root, "out")), "a failed compile left its output behind"
    return runs


@pytest.mark.parametrize("case", BAD_INPUTS)
def test_bad_input_gives_one_line_error(bad_input_runs, case):
    proc, needles = bad_input_runs[case]
    assert_user_error(proc, *needles)


# ---- the output contracts --------------------------------------------------------------------

def test_generate_json_and_seeds(cli_bundle):
    prompts = ["the cat", "hi", "there is the"]
    args = ["generate", cli_bundle, "--max-tokens", "4", "--temperature", "0.9", "--seed", "41", "--json"]
    for p in prompts:
        args += ["--prompt", p]
    proc = specbuild(*args)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.strip().splitlines()
    assert len(lines) == len(prompts)
    tokenizer = Tokenizer.from_file(os.path.join(cli_bundle, "tokenizer.json"))
    results = [json.loads(line) for line in lines]
    for i, (prompt, r) in enumerate(zip(prompts, results)):
        assert {"text", "token_ids", "finish_reason", "stats"} <= set(r)
        assert STATS_KEYS <= set(r["stats"])
        s = r["stats"]
        assert s["seed"] == 41 + i
        assert s["prompt_tokens"] == len(tokenizer.encode(prompt).ids)
        assert s["generated_tokens"] == len(r["token_ids"]) and 1 <= len(r["token_ids"]) <= 4
        assert r["finish_reason"] in ("length", "stop")
        assert s["target_passes"] >= 1 and s["tokens_per_s"] > 0 and s["ttft_ms"] >= 0 and s["tpot_ms"] >= 0
        assert isinstance(r["text"], str)
    # prompt 1 alone with its reported seed, streamed as text: the same tokens and text
    proc = specbuild("generate", cli_bundle, "--prompt", prompts[1], "--max-tokens", "4", "--temperature", "0.9",
                     "--seed", str(results[1]["stats"]["seed"]))
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == results[1]["text"] + "\n"
    assert "seed=42" in proc.stderr and f"{len(results[1]['token_ids'])} tokens" in proc.stderr


def test_inspect_json(cli_bundle):
    proc = specbuild("inspect", cli_bundle, "--json")
    assert proc.returncode == 0, proc.stderr
    info = json.loads(proc.stdout)
    assert info["schema_version"] == SCHEMA_VERSION
    assert info["limits"]["max_seq_len"] == MAX_SEQ_LEN
    assert info["tokenizer_fingerprint"].startswith("sha256:")
    target = info["roles"]["target"]
    cfg = target["config"]
    assert (cfg["num_layers"], cfg["hidden_size"], cfg["num_heads"], cfg["num_kv_heads"], cfg["vocab_size"]) == \
        (2, 64, 4, 2, 320)
    assert target["dtype"] == "float32" and target["source_format"] == "hf"
    assert target["files"]["weights.safetensors"] >= target["bytes"] > 0
    proc = specbuild("inspect", cli_bundle)
    assert proc.returncode == 0 and "max_seq_len=32" in proc.stdout


def test_generate_batch_with_one_system_prompt_computes_it_once(tiny_bundle):
    """`generate --chat --system S` with several prompts: the later prompts take the system
    prompt's blocks from the first (cached_tokens in --json's stats); --no-prefix-cache
    computes each in full and prints the same tokens."""
    system = " ".join(f"rule {i}: be brief" for i in range(8))
    args = ["generate", tiny_bundle, "--chat", "--system", system, "--max-tokens", "4", "--json",
            "--prompt", "the cat", "--prompt", "hi there", "--prompt", "what is it"]
    runs = {}
    for flag in ([], ["--no-prefix-cache"]):
        proc = specbuild(*args, *flag)
        assert proc.returncode == 0, proc.stderr
        runs[bool(flag)] = [json.loads(line) for line in proc.stdout.strip().splitlines()]
    on, off = runs[False], runs[True]
    assert [r["token_ids"] for r in on] == [r["token_ids"] for r in off]
    assert all(r["stats"]["cached_tokens"] == 0 for r in off) and on[0]["stats"]["cached_tokens"] == 0
    assert all(r["stats"]["cached_tokens"] >= 64 for r in on[1:]), [r["stats"]["cached_tokens"] for r in on]
