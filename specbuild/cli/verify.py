"""`specbuild verify`: is speculative sampling exactly the target's distribution?"""

from __future__ import annotations

import json

import click

from specbuild.cli.main import user_errors


@click.command()
@click.argument("bundle", type=click.Path())
@click.option("--speculation", "methods", default=None,
              help="Comma-separated methods to check [default: every drafter the bundle has].")
@click.option("--samples", default=600, show_default=True, type=int, help="Speculative samples per setting.")
@click.option("--temperatures", default="1.0,0.7", show_default=True, help="Comma-separated temperatures.")
@click.option("--top-k", default=3, show_default=True, type=int,
              help="Small top-k so the exact joint distribution can be enumerated.")
@click.option("--tokens", "n_tokens", default=3, show_default=True, type=int, help="Generated tokens compared jointly.")
@click.option("--gamma", default=4, show_default=True, type=int, help="Fixed draft length during the check.")
@click.option("--prompt", "prompts", multiple=True, help="Prompts [default: two built-in repetitive prompts].")
@click.option("--alpha", default=0.01, show_default=True, type=float, help="Family-wise level (Holm).")
@click.option("--seed", default=1234, show_default=True, type=int)
@click.option("--threads", type=int, default=None)
@click.option("--json", "as_json", is_flag=True)
@user_errors
def verify(bundle, methods, samples, temperatures, top_k, n_tokens, gamma, prompts, alpha, seed, threads, as_json):
    """Chi-square test of speculative sampling against the target's exact distribution.

    For each prompt, temperature and method: enumerate the exact joint distribution of the
    first --tokens tokens under plain decoding (top-k), draw --samples seeded speculative
    samples through the engine, and test goodness of fit (rare cells pooled). p-values are
    Holm-corrected across settings; the check passes when every adjusted p >= --alpha and
    drafts were proposed and accepted. Defaults take a few minutes on the default model.
    """
    from tqdm import tqdm

    from specbuild.engine.engine import Engine, EngineConfig
    from specbuild.speculation.config import SpeculationConfig
    from specbuild.bench.verify_dist import DEFAULT_PROMPTS, check, holm, settings

    if not 1 <= n_tokens <= 4:
        raise ValueError(f"--tokens {n_tokens} is out of range [1, 4]")
    if not 1 <= top_k <= 8:
        raise ValueError(f"--top-k {top_k} is out of range [1, 8] (the joint distribution is enumerated)")
    if samples < 50:
        raise ValueError(f"--samples {samples} is below 50")
    engine = Engine(bundle, EngineConfig(threads=threads))
    wanted = methods.split(",") if methods else [m for m in engine.methods if m not in ("none", "auto")]
    temps = [float(t) for t in temperatures.split(",")]
    runs = settings(temps, wanted, prompts or DEFAULT_PROMPTS)
    results = []
    with tqdm(total=samples * len(runs), desc="verify", unit="sample", disable=as_json) as bar:
        for prompt, temp, method in runs:
            spec = SpeculationConfig.make(None, method=method, gamma=gamma)
            results.append(check(engine, prompt, temp, top_k, spec, samples, n_tokens, seed, bar.update))
    adjusted = holm([r.p_value for r in results])
    ok = all(p >= alpha for p in adjusted) and all(r.drafted > 0 and r.accepted > 0 for r in results)
    if as_json:
        click.echo(json.dumps({"pass": ok, "alpha": alpha, "results": [
            {**r.to_json(), "p_holm": a} for r, a in zip(results, adjusted)]}, indent=2))
    else:
        click.echo(f"{'method':8s} {'temp':>5s} {'prompt':24s} {'chi2':>9s} {'dof':>4s} {'p':>8s} {'p_holm':>8s} "
                   f"{'accepted/drafted':>17s}")
        for r, a in zip(results, adjusted):
            click.echo(f"{r.method:8s} {r.temperature:5.2f} {r.prompt[:24]:24s} {r.statistic:9.2f} {r.dof:4d} "
                       f"{r.p_value:8.4f} {a:8.4f} {r.accepted:>8d}/{r.drafted:<8d}")
        click.echo("PASS" if ok else "FAIL")
    raise SystemExit(0 if ok else 1)
