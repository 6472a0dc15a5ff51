"""`specbuild verify`: is speculative sampling exactly the target's distribution?"""

from __future__ import annotations

import json

import click

from specbuild.cli.main import user_errors
from specbuild.cli.options import compile_option, shared


@click.command()
@click.argument("bundle", type=click.Path())
@click.option("--speculation", "methods", default=None,
              help="Comma-separated methods to check [default: every drafter the bundle has].")
@click.option("--samples", default=600, show_default=True, type=int, help="Speculative samples per setting.")
@click.option("--temperatures", default="1.0,0.7", show_default=True, help="Comma-separated temperatures.")
@shared("--top-k", default=3, show_default=True, help="Small top-k so the exact joint distribution can be enumerated.")
@click.option("--tokens", "n_tokens", default=3, show_default=True, type=int, help="Generated tokens compared jointly.")
@shared("--gamma", default=4, show_default=True, help="Fixed draft length during the check.")
@shared("--prompt", help="Prompts [default: two built-in repetitive prompts].")
@shared("--chat")
@click.option("--alpha", default=0.01, show_default=True, type=float, help="Family-wise level (Holm).")
@click.option("--min-accepted", default=20, show_default=True, type=int,
              help="Accepted drafts a setting needs; below it the setting is inconclusive, not passed.")
@shared("--seed", default=1234)
@shared("--threads")
@compile_option()
@shared("--json")
@user_errors
def verify(bundle, methods, samples, temperatures, top_k, n_tokens, gamma, prompts, chat, alpha, min_accepted, seed,
           threads, compile_, as_json):
    """Chi-square test of speculative sampling against the target's exact distribution.

    For each prompt, temperature and method: enumerate the exact joint distribution of the
    first --tokens tokens under plain decoding (top-k), draw --samples seeded speculative
    samples through the engine, and test goodness of fit (rare cells pooled). p-values are
    Holm-corrected across settings. Exit status: 0 PASS (every adjusted p >= --alpha and
    every setting accepted at least --min-accepted drafts); 1 FAIL (some adjusted p <
    --alpha: the distribution differs); 3 INCONCLUSIVE (no p-value fails, but some setting
    accepted too few drafts to judge; the output names it and what to run instead).
    Defaults take a few minutes on the default model.
    """
    from tqdm import tqdm

    from specbuild.engine.engine import Engine, EngineConfig
    from specbuild.speculation.config import SpeculationConfig
    from specbuild.bench.verify_dist import DEFAULT_PROMPTS, check, holm, settings, verdict

    if not 1 <= n_tokens <= 4:
        raise ValueError(f"--tokens {n_tokens} is out of range [1, 4]")
    if not 1 <= top_k <= 8:
        raise ValueError(f"--top-k {top_k} is out of range [1, 8] (the joint distribution is enumerated)")
    if samples < 50:
        raise ValueError(f"--samples {samples} is below 50")
    if min_accepted < 1:
        raise ValueError(f"--min-accepted {min_accepted} is below 1")
    engine = Engine(bundle, EngineConfig(threads=threads, compile=compile_))
    wanted = methods.split(",") if methods else [m for m in engine.methods if m not in ("none", "auto")]
    temps = [float(t) for t in temperatures.split(",")]
    texts = list(prompts or DEFAULT_PROMPTS)
    if chat:
        texts = [engine.render_chat([{"role": "user", "content": t}]) for t in texts]
    runs = settings(temps, wanted, texts)
    results = []
    with tqdm(total=samples * len(runs), desc="verify", unit="sample", disable=as_json) as bar:
        for prompt, temp, method in runs:
            spec = SpeculationConfig.make(None, method=method, gamma=gamma)
            results.append(check(engine, prompt, temp, top_k, spec, samples, n_tokens, seed, bar.update))
    adjusted = holm([r.p_value for r in results])
    v = verdict(results, adjusted, alpha, min_accepted, bundle)
    if as_json:
        click.echo(json.dumps({"pass": v.status == "pass", "verdict": v.status, "exit_code": v.exit_code,
                               "alpha": alpha, "min_accepted": min_accepted, "advice": list(v.advice),
                               "results": [{**r.to_json(), "p_holm": a, "status": st}
                                           for r, a, st in zip(results, adjusted, v.statuses)]}, indent=2))
    else:
        click.echo(f"{'method':8s} {'temp':>5s} {'prompt':24s} {'chi2':>9s} {'dof':>4s} {'p':>8s} {'p_holm':>8s} "
                   f"{'accepted/drafted':>17s} status")
        for r, a, st in zip(results, adjusted, v.statuses):
            prompt = r.prompt.replace("\n", " ")
            click.echo(f"{r.method:8s} {r.temperature:5.2f} {prompt[:24]:24s} {r.statistic:9.2f} {r.dof:4d} "
                       f"{r.p_value:8.4f} {a:8.4f} {r.accepted:>8d}/{r.drafted:<8d} {st}")
        for line in v.advice:
            click.echo(f"inconclusive: {line}")
        click.echo({"pass": "PASS", "fail": "FAIL: the distribution differs",
                    "inconclusive": "INCONCLUSIVE: no p-value fails, but some settings accepted too few drafts to judge "
                                    "(exit 3)"}[v.status])
    raise SystemExit(v.exit_code)
