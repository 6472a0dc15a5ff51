"""Every command-line option more than one command takes, declared once.

A command names a shared option with `shared("--threads")` and may change only what really
differs between commands (its default, a sentence of help); the option's name, type and
meaning live here. `tests/cli/test_options.py` refuses a second `click.option` declaration of
any option name in specbuild/cli/ (the few names that mean different things in different
commands are listed there with the reason).

The drafters' own settings are not listed here: each drafter module declares them in its
`Options` dataclass (proposers/registry.py), and a command made with `cls=DrafterCommand` takes
them as `--<drafter>-<setting>` options, added when the command is first parsed or its help
shown (listing the commands imports no drafter).

Imports only click, so every cli module may use it.
"""

from __future__ import annotations

import functools
from typing import Any

import click

BACKENDS = ["auto", "torch", "tensorrt-llm"]

# flag -> click.option keyword arguments ("decls": the declarations when they are not just the flag)
SHARED: dict[str, dict[str, Any]] = {
    # opening an engine
    "--threads": dict(type=int, default=None, help="Torch CPU threads."),
    "--device": dict(default="cpu", show_default=True, help="cpu, cuda, cuda:N."),
    "--backend": dict(default="auto", show_default=True, type=click.Choice(BACKENDS),
                      help="auto: TensorRT-LLM where the bundle's engines are built and it runs here, else torch."),
    # the TensorRT-LLM LLM-API path (backends/tensorrt_llm_api.py); --backend auto asks its checks with them
    "--trtllm-attn-backend": dict(type=click.Choice(["TRTLLM", "FLASHINFER", "VANILLA"], case_sensitive=False),
                                  default=None, help="TensorRT-LLM LLM API: attention backend [TRTLLM]. FLASHINFER "
                                                     "avoids the speculative XQA kernels a query group that is not a "
                                                     "power of two lacks."),
    "--trtllm-ngram-impl": dict(type=click.Choice(["trtllm", "specbuild"]), default=None,
                                help="TensorRT-LLM LLM API, ngram: TensorRT-LLM's NGramDecodingConfig (trtllm) or "
                                     "specbuild's prompt lookup through UserProvidedDecodingConfig [trtllm]."),
    "--compile": dict(decls=("--compile", "compile_"), is_flag=True,
                      help="Torch backend, CPU: run the layer stack compiled: int4 bundles on specbuild's "
                           "kernels as one fused C++ call, others through torch.compile (a compile at load, "
                           "cached on disk)."),
    "--max-batch-size": dict(type=int, default=None, help="Most sequences per step [bundle limit]."),
    "--kv-cache-tokens": dict(type=int, default=None, help="KV cache size in tokens [enough for the bundle's full batch; what a smaller --max-batch-size leaves holds the prefix cache]."),
    "--kv-cache-dtype": dict(type=click.Choice(["auto", "float32", "float16"]), default="auto", show_default=True,
                             help="The KV cache's element type (EngineConfig.kv_cache_dtype): float16 halves what "
                                  "attention reads and what a cached token takes (the fused int4 stack, --compile); "
                                  "auto takes it for int4-a8 bundles there, float32 elsewhere."),
    "--max-queue": dict(type=int, default=64, show_default=True,
                        help="Requests waiting for admission before new ones are refused."),
    "--telemetry": dict(decls=("--telemetry", "telemetry"), default=None, metavar="DB",
                        help="Record speculation sessions, steps and events into DB (a SQLite file, or a "
                             "postgresql:// DSN) and start sequences from its gamma policies."),
    "--content-type": dict(decls=("--content-type", "content_type"), default=None,
                           help="Content type for the gamma policy (code, structured, summarization, chat, or your "
                                "own name) [default: classified from the prompt]."),
    "--no-prefix-cache": dict(decls=("--no-prefix-cache", "no_prefix_cache"), is_flag=True,
                              help="Turn off automatic prefix caching (EngineConfig.prefix_cache): by default a "
                                   "prompt that begins with text an earlier request computed (a chat's next turn, "
                                   "a shared system prompt) reuses that text's KV blocks. Output is the same."),
    # prompts and speculation
    "--prompt": dict(decls=("--prompt", "prompts"), multiple=True, help="Prompt text (repeatable)."),
    "--chat": dict(is_flag=True, help="Render each prompt as a user turn in the bundle's chat template."),
    "--gamma": dict(type=int, default=None, help="Draft length; alone it fixes the depth."),
    "--gamma-min": dict(type=int, default=None, help="Lower bound of the dynamic depth (0 allows plain)."),
    "--gamma-max": dict(type=int, default=None, help="Upper bound of the dynamic depth."),
    "--tree": dict(default=None, help="Medusa token tree: preset name or JSON file."),
    "--seed": dict(type=int, default=0, show_default=True, help="Random seed."),
    "--max-tokens": dict(type=int, default=None, help="Most tokens to generate [bundle default: 128]."),
    "--temperature": dict(type=float, default=None, help="0 = greedy [bundle default: 0]."),
    "--top-k": dict(type=int, default=None, help="Keep the k most likely tokens (0 = off)."),
    # output
    "--json": dict(decls=("--json", "as_json"), is_flag=True, help="Machine-readable output (JSON)."),
    "--out": dict(decls=("--out", "out_dir"), required=True, type=click.Path(), help="Directory to write."),
    "--no-progress": dict(is_flag=True, help="No progress bar on stderr."),
    "--plot": dict(type=click.Path(dir_okay=False), default=None, help="Also draw the report into this PNG file."),
    "--model-name": dict(default=None, help="The model's name [the bundle directory's name]."),
    # training
    "--data": dict(decls=("--data", "data_path"), default=None, type=click.Path(),
                   help="Spec-Bench-style jsonl ({\"turns\": [...]} or {\"prompt\": ...}) [default: the packaged "
                        "Spec-Bench]. Its train split is used when the package's split covers its question ids, "
                        "else a seeded 90/10 split."),
    "--draft-vocab": dict(type=int, default=8192, show_default=True,
                          help="Output tokens: the N most frequent target tokens of the training text."),
    "--max-prompts": dict(type=int, default=128, show_default=True, help="Training prompts (seeded sample)."),
    "--eval-prompts": dict(type=int, default=12, show_default=True, help="Held-out prompts for the report."),
    "--max-answer-tokens": dict(type=int, default=128, show_default=True, help="Tokens per target answer."),
    "--max-prompt-tokens": dict(type=int, default=512, show_default=True, help="Longer prompts are skipped."),
    "--epochs": dict(type=float, default=4.0, show_default=True, help="Passes over the training positions."),
    "--steps": dict(type=int, default=None, help="Optimizer steps [default: --epochs over the positions]."),
    "--lr": dict(type=float, default=3e-4, show_default=True, help="AdamW peak learning rate."),
    "--train-minutes": dict(type=float, default=None, help="Stop training after this long (then save)."),
    "--checkpoint-minutes": dict(type=float, default=5.0, show_default=True, help="Checkpoint interval."),
    "--resume": dict(is_flag=True, help="Continue from the answers, hidden states and checkpoint in --out."),
}


def shared(flag: str, *, help_extra: str = "", **overrides: Any):
    """The click option `flag` as SHARED declares it, with this command's `overrides` (default,
    help, ...) and `help_extra` appended to its help."""
    if flag not in SHARED:
        raise KeyError(f"{flag} is not a shared option; declare it in specbuild/cli/options.py")
    spec = {**SHARED[flag], **overrides}
    decls = spec.pop("decls", (flag,))
    if help_extra:
        spec["help"] = (spec.get("help") or "") + help_extra
    return click.option(*decls, **spec)


def compile_option(extra: str = ""):
    """`--compile` (EngineConfig.compile) as every command that opens an engine takes it."""
    return shared("--compile", help_extra=extra)


def telemetry_option(fn):
    """--telemetry DB for the commands that run an engine (generate, serve, bench, triton-repo)."""
    return shared("--telemetry")(fn)


def content_type_option(fn):
    return shared("--content-type")(fn)


def gamma_options(fn):
    """--gamma, --gamma-min, --gamma-max (SpeculationConfig's depth fields)."""
    for flag in ("--gamma-max", "--gamma-min", "--gamma"):
        fn = shared(flag)(fn)
    return fn


class MethodChoice(click.Choice):
    """none, each registered drafter (proposers/registry.py, in its order; read when the value is
    checked or the help shown, so a drafter registered at run time is a choice too) and auto."""

    def __init__(self) -> None:
        super().__init__([])

    @property
    def choices(self) -> tuple[str, ...]:
        from specbuild.speculation.proposers.registry import names

        return ("none", *names(), "auto")

    @choices.setter
    def choices(self, _value) -> None:
        pass


def drafter_option(flat: str, f, help_extra: str = "") -> click.Option:
    """The click option of a drafter's setting `flat` (`<name>_<field>`) from its Options field
    `f`: a bool is a flag (one on by default an on/off pair), metadata "choices" a choice, "path" an existing file; its default is
    the field's; its help the field's metadata "help" (+ help_extra)."""
    import dataclasses

    meta = f.metadata
    default = f.default if f.default is not dataclasses.MISSING else None
    spec: dict[str, Any] = {"default": default, "help": str(meta.get("help", "")) + help_extra}
    if isinstance(default, bool):
        spec["is_flag"] = True
    elif meta.get("choices"):
        spec.update(type=click.Choice(list(meta["choices"])), show_default=True)
    elif meta.get("path"):
        spec["type"] = click.Path(exists=True, dir_okay=False)
    elif default is not None:
        spec.update(type=type(default), show_default=True)
    if meta.get("metavar"):
        spec["metavar"] = meta["metavar"]
    name = "--" + flat.replace("_", "-")
    if default is True:  # on by default: an on/off pair (--suffix-answers / --no-suffix-answers)
        spec.pop("is_flag")
        name = f"{name}/--no-{name[2:]}"
    return click.Option([name, flat], **spec)


class DrafterCommand(click.Command):
    """A command that takes the registered drafters' settings (their Options fields) as options
    `--<name>-<field>` (the suffix drafter's store_tokens: --suffix-store-tokens), handed to the callback as one `drafters` argument: {name: {field:
    value}} (EngineConfig.drafters, RepoConfig.drafters). `drafter_settings` keeps only those
    settings (`<name>_<field>` names; None: all); `drafter_help` adds a sentence to a setting's
    help. The options follow the registry (proposers/registry.py): a drafter registered later
    is picked up the next time the command is parsed."""

    def __init__(self, *args, drafter_settings: tuple[str, ...] | None = None,
                 drafter_help: dict[str, str] | None = None, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.drafter_settings = drafter_settings
        self.drafter_help = dict(drafter_help or {})
        self._drafter_params: list[click.Parameter] = []
        self._drafter_table: dict = {}

    def drafter_table(self) -> dict:
        """`<name>_<field>` -> (name, field) of the settings this command takes, its options in place."""
        from specbuild.speculation.proposers.registry import settings

        table = {k: v for k, v in settings().items() if self.drafter_settings is None or k in self.drafter_settings}
        if table.keys() != self._drafter_table.keys():
            self.params = [p for p in self.params if p not in self._drafter_params]
            self._drafter_params = [drafter_option(k, f, self.drafter_help.get(k, "")) for k, (_, f) in table.items()]
            self.params.extend(self._drafter_params)
            self._drafter_table = table
        return table

    def get_params(self, ctx: click.Context) -> list[click.Parameter]:
        self.drafter_table()
        return super().get_params(ctx)

    def invoke(self, ctx: click.Context) -> Any:
        drafters: dict[str, dict[str, Any]] = {}
        for key, (name, f) in self.drafter_table().items():
            if key in ctx.params:
                drafters.setdefault(name, {})[f.name] = ctx.params.pop(key)
        ctx.params["drafters"] = drafters
        return super().invoke(ctx)


TRTLLM_FIELDS = ("trtllm_attn_backend", "trtllm_ngram_impl")


def trtllm_options(fn):
    """--trtllm-attn-backend, --trtllm-ngram-impl, handed to the command as one `trtllm` dict of
    open_engine keywords (only those given)."""
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        kwargs["trtllm"] = {k: v for k in TRTLLM_FIELDS if (v := kwargs.pop(k)) is not None}
        return fn(*args, **kwargs)

    for field in reversed(TRTLLM_FIELDS):
        wrapper = shared("--" + field.replace("_", "-"))(wrapper)
    return wrapper
