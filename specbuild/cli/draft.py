"""`specbuild train-draft` and `specbuild export-draft`."""

from __future__ import annotations

import json

import click

from specbuild.cli.main import user_errors
from specbuild.cli.options import shared


@click.command("train-draft")
@click.argument("bundle", type=click.Path())
@shared("--data")
@shared("--out", help="Directory for the draft (and caches).")
@click.option("--layers", default=2, show_default=True, type=int, help="Decoder layers of the draft.")
@click.option("--hidden", default=None, type=int, help="MLP hidden size of the draft [default: the target's].")
@shared("--draft-vocab", help="Output tokens: the N most frequent target tokens (vocab_map).")
@click.option("--tokens", default=24000, show_default=True, type=int, help="Answer tokens to distil in all.")
@click.option("--sampled-share", default=0.25, show_default=True, type=float,
              help="Share of those tokens from sampled (not greedy) target answers.")
@click.option("--prompt-positions/--answer-positions", default=True, show_default=True,
              help="Learn the target's distributions at every position, or only where it wrote the answer.")
@click.option("--init-layers", default=None,
              help="Target layers to start from, e.g. 0,1 [default: the first --layers].")
@shared("--epochs", help="Passes over the answers.")
@click.option("--batch-seqs", default=4, show_default=True, type=int, help="Sequences per step.")
@shared("--lr")
@shared("--max-answer-tokens")
@shared("--max-prompt-tokens")
@shared("--eval-prompts")
@shared("--train-minutes")
@shared("--checkpoint-minutes", default=3.0)
@shared("--seed")
@shared("--threads")
@shared("--device")
@shared("--resume")
@user_errors
def train_draft_cmd(bundle, data_path, out_dir, layers, hidden, draft_vocab, tokens, sampled_share, prompt_positions,
                    init_layers,
                    epochs, batch_seqs, lr, max_answer_tokens, max_prompt_tokens, eval_prompts, train_minutes,
                    checkpoint_minutes, seed, threads, device, resume) -> None:
    """Distil a small draft model (sharing the target's embedding) from BUNDLE's target."""
    import torch

    from specbuild.train.draft import DraftTrainConfig, train_draft

    if threads:
        torch.set_num_threads(threads)
    try:
        init = tuple(int(x) for x in init_layers.split(",")) if init_layers else None
    except ValueError:
        raise click.BadParameter(f"{init_layers!r} is not a comma-separated list of layer numbers",
                                 param_hint="--init-layers") from None
    cfg = DraftTrainConfig(layers=layers, hidden=hidden, draft_vocab=draft_vocab, tokens=tokens,
                           sampled_share=sampled_share, prompt_positions=prompt_positions, init_layers=init,
                           epochs=epochs, batch_seqs=batch_seqs, lr=lr,
                           max_answer_tokens=max_answer_tokens, max_prompt_tokens=max_prompt_tokens,
                           eval_prompts=eval_prompts, train_minutes=train_minutes,
                           checkpoint_minutes=checkpoint_minutes, seed=seed, device=device)
    report = train_draft(bundle, data_path, out_dir, cfg, resume=resume, log=lambda m: click.echo(m, err=True))
    s = report["seconds"]
    click.echo(f"draft written to {out_dir} in {s['total']:.0f}s (answers {s['distill']:.0f}s, hidden "
               f"{s['hidden']:.0f}s, training {s['train']:.0f}s)", err=True)
    if report["eval_after"]:
        click.echo(f"eval: top-1 agreement with the target {report['eval_after']['top1_agreement']:.1%} "
                   f"(untrained {report['eval_before']['top1_agreement']:.1%}) over "
                   f"{report['eval_after']['positions']} positions", err=True)
    click.echo(f"use it: specbuild compile --target ... --draft {out_dir}", err=True)


@click.command("export-draft")
@click.argument("bundle", type=click.Path())
@shared("--out")
@user_errors
def export_draft_cmd(bundle, out_dir) -> None:
    """Write BUNDLE's draft as a standalone Hugging Face directory (shared tensors copied,
    full vocabulary: rows outside the vocab_map are zero, i.e. logit 0)."""
    from specbuild.compiler.draft_role import export_draft

    click.echo(json.dumps(export_draft(bundle, out_dir)))
