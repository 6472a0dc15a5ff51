"""The `specbuild` command: each subcommand parses, builds a config, calls one function.

User errors (SpecbuildError, ValueError from configs) print one line and exit non-zero,
without a traceback.
"""

from __future__ import annotations

import functools
import json
import os
import sys

# OpenMP spinning is configured in specbuild/__init__.py, before torch loads.

import click  # noqa: E402

from specbuild.cli.lazy import LazyGroup
from specbuild.cli.options import DrafterCommand, compile_option, content_type_option, gamma_options, shared, telemetry_option
from specbuild.cli.options import MethodChoice, trtllm_options
from specbuild.errors import SpecbuildError

__all__ = ["main", "user_errors", "compile_option", "fail_once", "dist_context"]  # compile_option: options.py


def user_errors(fn):
    """Turn user-input errors into a one-line message and exit status 2."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except (SpecbuildError, ValueError) as e:
            click.echo(f"error: {e}", err=True)
            sys.exit(2)

    return wrapper


def fail_once(e: Exception) -> None:
    """A start-up refusal that every MPI rank reaches alike: rank 0 prints it (one line, not
    one per rank) and every rank exits 2."""
    from specbuild.mpi.context import launcher_rank_size

    if launcher_rank_size()[0] == 0:
        click.echo(f"error: {e}", err=True)
    sys.exit(2)


def dist_context(bundle: str, backend: str, command: str, parallel_draft: bool = False):
    """This process's `parallel.DistContext`, the MPI world size checked against what the bundle
    needs on the chosen backend (TensorRT-LLM engines: their tp*pp; torch: 1, or 2 with
    --parallel-draft). A mismatch is refused on every rank, printed once (`fail_once`)."""
    from specbuild.mpi.context import TORCH, DistContext, bundle_world

    try:
        need = TORCH if parallel_draft else bundle_world(bundle, backend)
        return DistContext.create(parallel_draft, need, command)  # --parallel-draft: a guard until the child ends
    except (SpecbuildError, ValueError) as e:
        fail_once(e)


@click.group(cls=LazyGroup)
@click.version_option(package_name="specbuild")
def main() -> None:
    """specbuild: compile speculation bundles and run them with lossless speculative decoding."""


@main.command()
@click.option("--target", required=True, help="Target model: a HF directory, a .gguf file or a preset (smollm2-135m).")
@click.option("--draft", default=None, help="Draft model (same tokenizer as the target).")
@click.option("--medusa", default=None, help="Medusa heads (FasterDecoding or TensorRT-LLM layout) for the target.")
@click.option("--eagle", default=None, help="EAGLE-3 head directory (the layout vLLM/SGLang load; train-eagle's output).")
@shared("--tree", help="Medusa token tree: preset name or JSON file [default: a chain per head].")
@shared("--out", help="Bundle directory to write.")
@click.option("--dtype", default="float32", type=click.Choice(["float32", "bfloat16", "float16"]), show_default=True)
@click.option("--max-seq-len", default=2048, show_default=True, type=int, help="Longest prompt + output.")
@shared("--max-batch-size", default=8, show_default=True, help="Most sequences in one step (the bundle's limit).")
@click.option("--max-draft-len", default=8, show_default=True, type=int, help="Most draft tokens per step.")
@click.option("--backend", default="torch", show_default=True, type=click.Choice(["torch", "tensorrt-llm"]),
              help="tensorrt-llm also writes TensorRT-LLM checkpoints (and builds engines where it is installed).")
@click.option("--tp", default=1, show_default=True, type=int, help="Tensor parallelism (tensorrt-llm).")
@click.option("--pp", default=1, show_default=True, type=int, help="Pipeline parallelism, 1 or 2 (tensorrt-llm).")
@click.option("--trtllm-dtype", default="float16", show_default=True,
              type=click.Choice(["float16", "bfloat16", "float32"]), help="Weight dtype of the TensorRT-LLM checkpoints.")
@click.option("--trtllm-gather-generation-logits", is_flag=True,
              help="Build the draft and target engines with --gather_generation_logits (tensorrt-llm with --draft): "
                   "needed to speculate on sampled (temperature > 0) requests; costs GPU memory.")
@click.option("--quantize", default="none", show_default=True, type=click.Choice(["none", "int8", "int4"]),
              help="Weight-only quantization of the layers' linear weights (a GGUF's Q4_1 is carried into int4).")
@click.option("--group-size", default=32, show_default=True, type=click.Choice(["32", "64", "128"]),
              help="Inputs per int4 scale/zero (32 carries GGUF Q4_1 blocks as they are).")
@click.option("--activations", default="bfloat16", show_default=True,
              type=click.Choice(["bfloat16", "float32", "int8", "auto"]),
              help="Dtype quantized weights multiply in (float32: Q4_1 exact, but torch's CPU kernels are slow; "
                   "int8: with --quantize int8 each input row rounded to int8 with its own scale, W8A8 (+3% "
                   "perplexity); with --quantize int4 to int8 blocks of 32, specbuild's int4 x int8 CPU kernel "
                   "(int4-a8, perplexity +0.07-0.26% of float32's); auto, --quantize int4 only: int4-a8 where "
                   "that kernel runs (x86-64 with AVX2), else bfloat16, chosen at load and said in one line).")
@click.option("--embedding-format", default="dense", show_default=True,
              type=click.Choice(["dense", "float32", "bfloat16", "float16", "int8", "int4"]),
              help="Embedding storage (dense = --dtype); tied embeddings follow --lm-head-format.")
@click.option("--lm-head-format", default="dense", show_default=True,
              type=click.Choice(["dense", "float32", "bfloat16", "float16", "int8", "int4"]), help="lm_head format.")
@click.option("--lm-head-activations", default="float32", show_default=True,
              type=click.Choice(["float32", "int8", "auto"]),
              help="What an int8 lm_head multiplies: float32 inputs, or the final hidden states rounded to int8 "
                   "blocks of 32 as int4-a8 rounds the layers' inputs, through specbuild's int8 x int8 kernel "
                   "(AVX512-VNNI or AVX2, the same bits; half the cost per verify row; perplexity with int4-a8 "
                   "layers +0.57% of float32's, docs/cpu-kernels.md); int8 needs that kernel at load (x86-64 "
                   "with AVX2); auto: int8 where it runs, else float32, chosen at load and said in one line. "
                   "Needs --lm-head-format int8.")
@click.option("--wide-format", "wide_formats", multiple=True, type=click.Choice(["float32", "bfloat16"]),
              help="Dense copies of quantized weights built at load for wide verification [float32].")
@user_errors
def compile(target, draft, medusa, eagle, tree, out_dir, dtype, max_seq_len, max_batch_size, max_draft_len, backend, tp, pp,
            trtllm_dtype, trtllm_gather_generation_logits, quantize, group_size, activations, embedding_format,
            lm_head_format, lm_head_activations, wide_formats) -> None:
    """Compile checkpoints into a speculation bundle."""
    import time

    from specbuild.compiler.compile import CompileOptions, compile_bundle

    t0 = time.perf_counter()
    options = CompileOptions(dtype=dtype, max_seq_len=max_seq_len, max_batch_size=max_batch_size,
                             max_draft_len=max_draft_len, backend=backend, tp=tp, pp=pp, trtllm_dtype=trtllm_dtype,
                             trtllm_gather_generation_logits=trtllm_gather_generation_logits,
                             quantize=quantize, group_size=int(group_size), activations=activations,
                             embedding_format=embedding_format, lm_head_format=lm_head_format,
                             lm_head_activations=lm_head_activations, formats=tuple(wide_formats) or ("float32",))
    compile_bundle(target, out_dir, options, draft=draft, medusa=medusa, tree=tree, eagle=eagle,
                   progress=lambda m: click.echo(m, err=True))
    click.echo(f"bundle written to {out_dir} in {time.perf_counter() - t0:.1f}s", err=True)


@main.command()
@click.argument("bundle", type=click.Path())
@shared("--json")
@user_errors
def inspect(bundle, as_json) -> None:
    """Show a bundle's roles, dimensions, dtype, sizes, tokenizer fingerprint and limits."""
    from specbuild.bundle import check_fingerprint, read_meta, read_model_config

    meta = read_meta(bundle)
    check_fingerprint(bundle, meta)
    info = {"bundle": os.path.abspath(bundle), "schema_version": meta.schema_version,
            "specbuild_version": meta.specbuild_version, "backend": meta.backend,
            "tokenizer_fingerprint": meta.tokenizer_fingerprint, "limits": meta.limits.__dict__,
            "default_sampling": meta.default_sampling, "default_speculation": meta.default_speculation,
            "roles": {}}
    for role, entry in meta.roles.items():
        role_dir = os.path.join(bundle, entry["path"])
        cfg = read_model_config(role_dir) if os.path.isfile(os.path.join(role_dir, "model.json")) else None
        files = {f: os.path.getsize(os.path.join(role_dir, f)) for f in sorted(os.listdir(role_dir))} \
            if os.path.isdir(role_dir) else {}
        info["roles"][role] = {**entry, "config": cfg.to_json() if cfg else None, "files": files}
        quant_path = os.path.join(role_dir, "quant.json")
        if os.path.isfile(quant_path):
            with open(quant_path) as f:
                info["roles"][role]["quant"] = json.load(f)
    from specbuild.backends.select import bundle_guarantees, guarantee_lines

    if meta.backend == "tensorrt-llm":
        info["trtllm"] = trtllm_info(bundle)
    info["guarantees"] = bundle_guarantees(bundle)
    from specbuild.speculation.proposers.registry import describe_settings

    # the drafters' settings (their modules' Options): EngineConfig `<name>_<field>`, --<name>-<field>
    info["drafter_settings"] = describe_settings()
    if as_json:
        click.echo(json.dumps(info, indent=2))
        return
    click.echo(f"bundle {info['bundle']}  (schema {meta.schema_version}, specbuild {meta.specbuild_version}, "
               f"backend {meta.backend})")
    click.echo(f"tokenizer {meta.tokenizer_fingerprint}")
    lim = meta.limits
    click.echo(f"limits    max_seq_len={lim.max_seq_len} max_batch_size={lim.max_batch_size} "
               f"max_draft_len={lim.max_draft_len}")
    click.echo(f"defaults  sampling={meta.default_sampling} speculation={meta.default_speculation}")
    for role, r in info["roles"].items():
        c = r["config"] or {}
        click.echo(f"role {role}: {c.get('architecture')} layers={c.get('num_layers')} hidden={c.get('hidden_size')} "
                   f"heads={c.get('num_heads')}/{c.get('num_kv_heads')} vocab={c.get('vocab_size')} "
                   f"dtype={r.get('dtype')} bytes={r.get('bytes'):,}  source={r.get('source_format')}")
        for f, size in r["files"].items():
            click.echo(f"    {f:28s} {size:>14,d} B")
        if "quant" in r:
            for line in quant_lines(r["quant"]):
                click.echo("    " + line)
    if "trtllm" in info:
        for line in trtllm_lines(info["trtllm"]):
            click.echo(line)
    for table in info["guarantees"].values():
        for line in guarantee_lines(table):
            click.echo(line)
    click.echo("drafter settings (--<drafter>-<setting>, Triton parameter <drafter>_<setting>):")
    for key, s in info["drafter_settings"].items():
        click.echo(f"  {key:24s} default {s['default']!s:10s} {s['help']}")


def trtllm_info(bundle: str) -> dict:
    """inspect's view of the bundle's TensorRT-LLM part (trtllm/trtllm.json, and which engines exist)."""
    from specbuild.backends.tensorrt_llm import engine_dirs, read_trtllm_meta

    trt = read_trtllm_meta(bundle)
    built = {role: os.path.isfile(os.path.join(d, "config.json")) for role, d in engine_dirs(bundle).items()}
    return {"mode": trt["mode"], "dtype": trt["dtype"], "limits": trt["limits"],
            "gather_generation_logits": bool(trt.get("gather_generation_logits")),
            "roles": {role: {"tp": r["tp"], "pp": r["pp"], "engine_built": built[role]}
                      for role, r in trt["roles"].items()},
            "build_script": os.path.join("trtllm", trt["build_script"])}


def trtllm_lines(trt: dict) -> list[str]:
    """inspect's summary of the TensorRT-LLM part: mode, engines, whether they gather generation logits."""
    lim = trt["limits"]
    roles = ", ".join(f"{role} tp={r['tp']} pp={r['pp']} engine {'built' if r['engine_built'] else 'not built'}"
                      for role, r in trt["roles"].items())
    lines = [f"tensorrt-llm mode={trt['mode']} dtype={trt['dtype']} max_seq_len={lim['max_seq_len']} "
             f"max_batch_size={lim['max_batch_size']} max_draft_len={lim['max_draft_len']}",
             f"    {roles} (build: {trt['build_script']})"]
    if trt["gather_generation_logits"]:
        lines.append("    gather_generation_logits=yes: sampled requests speculate with the draft engine")
    elif trt["mode"] == "draft_tokens_external":
        lines.append("    gather_generation_logits=no: sampled requests cannot speculate (recompile with "
                     "--trtllm-gather-generation-logits)")
    else:
        lines.append("    gather_generation_logits=no")
    return lines


def quant_lines(quant: dict) -> list[str]:
    """inspect's summary of quant.json: bytes per format, copies, what was carried or converted."""
    lines = ["bytes by format: " + ", ".join(f"{f} {b:,}" for f, b in quant["bytes_by_format"].items())
             + f"; activations {quant['activations']}; copies built at load: {', '.join(quant['formats']) or 'none'}"]
    groups: dict[tuple, list] = {}
    for name, e in quant["tensors"].items():
        kind = name.rsplit(".", 1)[-1]
        groups.setdefault((e["conversion"], e["format"], e["source_type"], kind), []).append(e.get("max_abs_change", 0.0))
    for (how, fmt, src, kind), changes in sorted(groups.items()):
        lines.append(f"{how:9s} {kind:8s} x{len(changes):<3d} {src} -> {fmt}"
                     + (f"  max weight change {max(changes):.3g}" if max(changes) > 0 else ""))
    return lines


def sampling_options(fn):
    for opt in reversed([
        shared("--max-tokens"),
        shared("--temperature"),
        shared("--top-k"),
        click.option("--top-p", type=float, default=None, help="Nucleus mass in (0, 1] (1 = off)."),
        shared("--seed", default=None, show_default=False, help="Seed; prompt i gets seed + i. Unset: drawn and reported."),
        click.option("--stop", multiple=True, help="Stop string (repeatable); the text ends where it begins."),
        click.option("--ignore-eos", is_flag=True, help="Keep generating past end-of-sequence tokens."),
        click.option("--presence-penalty", type=float, default=None, help="OpenAI's presence penalty in [-2, 2]."),
        click.option("--frequency-penalty", type=float, default=None, help="OpenAI's frequency penalty in [-2, 2]."),
    ]):
        fn = opt(fn)
    return fn


def speculation_options(fn):
    for opt in reversed([
        click.option("--speculation", type=MethodChoice(), default=None,
                     help="Drafter [bundle default]. auto picks per sequence by measured tokens/s."),
        gamma_options,
        shared("--tree"),
        click.option("--typical", is_flag=True, default=None,
                     help="Medusa typical acceptance. LOSSY: output is no longer the target's distribution."),
    ]):
        fn = opt(fn)
    return fn


def make_speculation(engine, speculation, gamma, gamma_min, gamma_max, tree, typical):
    from specbuild.speculation.config import SpeculationConfig
    from specbuild.speculation.tree import tree_argument

    return SpeculationConfig.make(engine.default_speculation, method=speculation, gamma=gamma, gamma_min=gamma_min,
                                  gamma_max=gamma_max, tree=tree_argument(tree), typical=typical)


def make_sampling(engine, max_tokens, temperature, top_k, top_p, seed, stop, ignore_eos, index=0,
                  presence_penalty=None, frequency_penalty=None):
    fields = {"max_tokens": max_tokens, "temperature": temperature, "top_k": top_k, "top_p": top_p,
              "seed": None if seed is None else seed + index, "stop": tuple(stop) or None,
              "ignore_eos": ignore_eos or None, "presence_penalty": presence_penalty,
              "frequency_penalty": frequency_penalty}
    from specbuild.sampling.params import SamplingParams

    return SamplingParams.from_dict({k: v for k, v in fields.items() if v is not None}, engine.default_sampling)


@main.command(cls=DrafterCommand)
@click.argument("bundle", type=click.Path())
@shared("--prompt", required=True, help="Prompt text (repeat for a batch).")
@shared("--chat", help="Wrap each prompt in the model's chat template.")
@click.option("--system", default=None, help="System message (with --chat).")
@sampling_options
@speculation_options
@shared("--threads")
@shared("--device", help="cpu, cuda, cuda:N (torch backend).")
@shared("--backend")
@trtllm_options
@compile_option()
@shared("--json", help="Print one JSON object per prompt instead of streaming text.")
@click.option("--json-schema", "json_schema", type=click.Path(exists=True, dir_okay=False), default=None,
              help="Structured output: the answer is JSON valid against this schema file (strict).")
@click.option("--regex", default=None, help="Structured output: the answer matches this regular expression.")
@click.option("--grammar", type=click.Path(exists=True, dir_okay=False), default=None,
              help="Structured output: the answer follows this grammar file (Lark syntax, as llguidance reads it).")
@click.option("--logprobs", type=int, default=None,
              help="With --json: each token's logprob and the N most likely alternatives (0..20).")
@telemetry_option
@content_type_option
@shared("--no-prefix-cache")
@shared("--kv-cache-dtype")
@user_errors
def generate(bundle, prompts, chat, system, max_tokens, temperature, top_k, top_p, seed, stop, ignore_eos,
             presence_penalty, frequency_penalty, speculation, gamma, gamma_min, gamma_max, tree, typical, threads,
             device, backend, compile_, as_json, json_schema, regex, grammar, logprobs, telemetry, content_type,
             no_prefix_cache, kv_cache_dtype, trtllm, drafters) -> None:
    """Generate text from one or more prompts (batched)."""
    from specbuild.backends.select import open_engine
    from specbuild.engine.engine import EngineConfig
    from specbuild.mpi.context import follow_leader
    from specbuild.engine.sequence import Request

    dist_context(bundle, backend, "generate")  # under `mpirun -n tp*pp`: TensorRT-LLM leader mode
    engine = open_engine(bundle, EngineConfig(device=device, threads=threads, compile=compile_,
                                              prefix_cache=not no_prefix_cache, kv_cache_dtype=kv_cache_dtype,
                                              drafters=drafters),
                         backend=backend, **trtllm)
    if follow_leader(engine, say=lambda line: click.echo(line, err=True)):  # ranks > 0: until rank 0 is done
        return
    from specbuild.engine.base import quiet_gc
    from specbuild.speculation.policy import check_content_type

    quiet_gc()  # loaded: the steps that follow leave the collector's walks out

    check_content_type(content_type)
    sink = None
    if telemetry:  # (cli.telemetry.open_telemetry does this for the other commands; it imports this module)
        from specbuild.telemetry import attach

        sink = attach(engine, telemetry, source="generate")
    spec = make_speculation(engine, speculation, gamma, gamma_min, gamma_max, tree, typical)
    # no speculation flag: the backend's default (the TensorRT-LLM backend may then serve a sampled
    # request without drafts where it cannot speculate losslessly, instead of refusing it)
    asked = any(v is not None for v in (speculation, gamma, gamma_min, gamma_max, tree, typical))
    request_spec = spec if asked else None
    if spec.typical:
        click.echo("warning: --typical acceptance is LOSSY: output is not the target's distribution", err=True)
    formats = [f for f in (json_schema and "json_schema", regex and "regex", grammar and "grammar") if f]
    if len(formats) > 1:
        raise click.UsageError(f"give at most one of --json-schema, --regex, --grammar (got {', '.join(formats)})")
    response_format = None
    if json_schema:
        with open(json_schema, encoding="utf-8") as f:
            response_format = {"type": "json_schema", "json_schema": {"name": os.path.basename(json_schema),
                                                                      "schema": json.load(f), "strict": True}}
    elif regex:
        response_format = {"type": "regex", "regex": regex}
    elif grammar:
        with open(grammar, encoding="utf-8") as f:
            response_format = {"type": "grammar", "grammar": f.read()}
    # the threading is timed in this thread, which runs the steps, before any request arrives: timed
    # at the first step, its ~0.4 s of candidate forwards made the first request's TTFT 420-445 ms
    # against 30-35 ms (AMD EPYC, a 40-token prompt, 2026-12-07)
    decide = getattr(engine, "decide_threads", None)
    if decide is not None:
        decide()
    handles = []
    for i, prompt in enumerate(prompts):
        params = make_sampling(engine, max_tokens, temperature, top_k, top_p, seed, stop, ignore_eos, i,
                               presence_penalty, frequency_penalty)
        extra = dict(sampling=params, speculation=request_spec, response_format=response_format, logprobs=logprobs,
                     content_type=content_type)
        if chat:
            messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": prompt}]
            ids = engine.encode(engine.render_chat(messages), add_special_tokens=False)
            handles.append(engine.submit(Request(prompt_ids=ids, **extra)))
        else:
            handles.append(engine.submit(Request(prompt=prompt, **extra)))
    if as_json:
        engine.run_until_done()
        for h in handles:
            click.echo(json.dumps(h.result()))
        if sink:
            sink.close()
        engine.close()
        return
    stream = len(handles) == 1
    for i, h in enumerate(handles):
        if len(handles) > 1:
            click.echo(f"--- prompt {i}")
        if stream:
            for ev in h:
                click.echo(ev.text, nl=False)
            r = h.result()
        else:
            r = h.result()
            click.echo(r["text"], nl=False)
        s = r["stats"]
        click.echo("")
        spec_info = (f", {spec.method}: mean accepted {s['mean_accepted_tokens']:.2f} tokens/pass, "
                     f"{s['accepted']}/{s['drafted']} drafts accepted") if spec.enabled else ""
        click.echo(f"[{s['generated_tokens']} tokens, {s['tokens_per_s']:.1f} tok/s, ttft {s['ttft_ms']:.0f} ms, "
                   f"finish={r['finish_reason']}, seed={s['seed']}{spec_info}]", err=True)
        if s.get("stat_speculation_off"):
            click.echo(f"note: served without drafts: {s['stat_speculation_off']}", err=True)
    if sink:
        sink.close()
        st = sink.stats()
        from specbuild.telemetry.store import describe

        click.echo(f"[telemetry: {st['telemetry_rows_written']} rows written to {describe(telemetry)}, "
                   f"{st['telemetry_rows_dropped']} dropped]", err=True)
    engine.close()


if __name__ == "__main__":
    main()
