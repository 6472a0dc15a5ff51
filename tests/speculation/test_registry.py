"""Adding a drafter is one module and one registry line: the module below is written to disk
as a user would write it, registered with proposers.registry.register (the line
proposers/registry.py holds for each built-in drafter), and served by an unchanged engine:
greedy output equals plain decoding, its drafts are proposed and some accepted, the logits
it declared it reads reach it, and its own per-sequence state is freed."""

from __future__ import annotations

import sys
import textwrap

import pytest

from specbuild.engine.engine import Engine, EngineConfig
from specbuild.engine.sequence import Request
from specbuild.errors import RequestError
from specbuild.sampling.params import SamplingParams
from specbuild.speculation.config import SpeculationConfig
from specbuild.speculation.proposers import registry

TOY = textwrap.dedent('''
    """A toy drafter: the target's last top token after each token, walked as a chain."""
    from specbuild.speculation.proposers.base import Draft, DrafterBase, Needs


    class BigramProposer(DrafterBase):
        name = "toy_bigram"
        needs = Needs(logits=True)

        def __init__(self):
            self.next_of = {}  # token -> the target's top token after it (shared by all requests)
            self.passes = {}  # seq_id -> passes observed (its own per-sequence state)
            self.proposed = 0

        def propose(self, seqs, gammas):
            out = []
            for seq, gamma in zip(seqs, gammas):
                tokens, tok = [], seq.all_ids[-1]
                while len(tokens) < gamma and tok in self.next_of:
                    tok = self.next_of[tok]
                    tokens.append(tok)
                self.proposed += len(tokens)
                out.append(Draft(tokens, method=self.name) if tokens else None)
            return out

        def observe(self, seq, obs):
            for tok, row in zip(obs.tokens, obs.logits):
                self.next_of[tok] = int(row.argmax())
            self.passes[seq.seq_id] = self.passes.get(seq.seq_id, 0) + 1

        def release(self, seq):
            self.passes.pop(seq.seq_id, None)


    def build(ctx):
        return BigramProposer()
''')

PROMPTS = [[5, 6, 7, 8, 9, 10, 11, 5, 6, 7, 8], [20, 21, 22, 20, 21], list(range(30, 60))]


def registered(tmp_path, monkeypatch, name: str, source: str):
    """A drafter module written to tmp_path and registered under `name` (a fixture's body:
    yields the name, then unregisters it and forgets the module)."""
    (tmp_path / f"{name}.py").write_text(source)
    monkeypatch.syspath_prepend(str(tmp_path))
    registry.register(name, name)
    yield name
    registry.unregister(name)
    sys.modules.pop(name, None)


@pytest.fixture
def toy_drafter(tmp_path, monkeypatch):
    yield from registered(tmp_path, monkeypatch, "toy_bigram", TOY)


def run(engine, method):
    spec = SpeculationConfig.make(None, method=method, gamma=4)
    return engine.generate([Request(prompt_ids=p, speculation=spec,
                                    sampling=SamplingParams(max_tokens=40, ignore_eos=True)) for p in PROMPTS])


def test_a_drafter_added_as_one_module_is_served_losslessly(tiny_bundle, toy_drafter):
    engine = Engine(tiny_bundle, EngineConfig(max_batch_size=4))
    assert toy_drafter in engine.methods
    toy = engine.speculator.proposers[toy_drafter]
    plain = run(engine, "none")
    for _ in range(2):  # the second round starts from the first round's table
        spec = run(engine, toy_drafter)
        for s, p in zip(spec, plain):
            assert s["token_ids"] == p["token_ids"]
    assert toy.proposed > 0 and sum(r["stats"]["drafted"] for r in spec) > 0
    assert sum(r["stats"]["accepted"] for r in spec) > 0
    assert toy.next_of and toy.passes == {}  # it learned from the logits; its state was freed
    assert engine.cache.used_blocks == 0


def test_an_unregistered_drafter_is_refused_by_name(tiny_bundle):
    with pytest.raises(RequestError, match="toy_bigram"):
        SpeculationConfig.make(None, method="toy_bigram")
    with pytest.raises(ValueError, match="'auto'"):
        registry.register("auto", "x")


CAPPED = textwrap.dedent('''
    """A toy drafter with a setting: the prompt-lookup drafter's drafts cut to `max_draft` tokens."""
    from dataclasses import dataclass, field

    from specbuild.speculation.proposers.base import DrafterBase, DrafterOptions
    from specbuild.speculation.proposers.ngram import NgramProposer


    @dataclass(frozen=True)
    class Options(DrafterOptions):
        max_draft: int = field(default=3, metadata={"help": "Most tokens a toy draft holds."})

        def __post_init__(self):
            if not 1 <= self.max_draft <= 16:
                raise ValueError(f"toy_capped_max_draft={self.max_draft} is out of range [1, 16]")


    GUARANTEE = ("lossless", "lossless", "toy: specbuild verify, capped prompt lookup")


    class CappedProposer(DrafterBase):
        name = "toy_capped"

        def __init__(self, max_draft):
            self.max_draft, self.lookup, self.longest = max_draft, NgramProposer(), 0

        def propose(self, seqs, gammas):
            drafts = self.lookup.propose(seqs, [min(g, self.max_draft) for g in gammas])
            for d in drafts:
                if d is not None:
                    d.method = self.name
                    self.longest = max(self.longest, len(d))
            return drafts


    def build(ctx):
        return CappedProposer(ctx.options.max_draft)
''')


@pytest.fixture
def capped_drafter(tmp_path, monkeypatch):
    yield from registered(tmp_path, monkeypatch, "toy_capped", CAPPED)


def test_a_drafter_with_a_setting_is_one_module_and_its_setting_reaches_every_front_end(tiny_bundle, capped_drafter,
                                                                                         tmp_path):
    """The toy's one setting (its Options field max_draft) is the CLI option --toy-capped-max-draft,
    the Triton model parameter toy_capped_max_draft (written by triton-repo and read back into
    EngineConfig), a field of /health's body and a line of `specbuild inspect`, with its
    guarantee row; the engine builds the drafter with the value given, which it checks."""
    from click.testing import CliRunner

    from specbuild.cli.main import main
    from specbuild.serve.openai_http import OpenAIServer, ServeConfig
    from specbuild.serve.tritonserver_model import config_parameters, drafter_settings

    # the command line: generate, serve and triton-repo take it
    for command in ("generate", "serve", "triton-repo"):
        r = CliRunner().invoke(main, [command, "--help"])
        assert r.exit_code == 0 and "--toy-capped-max-draft" in r.output and "Most tokens a toy draft" in r.output
    assert "toy_capped" in CliRunner().invoke(main, ["generate", "--help"]).output  # a --speculation choice
    # a Triton parameter: triton-repo writes it, the model reads it into EngineConfig
    out = tmp_path / "repo"
    r = CliRunner().invoke(main, ["triton-repo", tiny_bundle, "--out", str(out), "--toy-capped-max-draft", "2"])
    assert r.exit_code == 0, r.output
    params = {}
    for line in (out / "specbuild" / "config.pbtxt").read_text().splitlines():
        if line.startswith("parameters {"):
            key = line.split('key: "', 1)[1].split('"', 1)[0]
            params[key] = {"string_value": line.split('string_value: "', 1)[1].rsplit('"', 1)[0]}
    assert params["toy_capped_max_draft"] == {"string_value": "2"}
    settings = drafter_settings(config_parameters({"parameters": params}))
    assert settings["toy_capped_max_draft"] == 2
    config = EngineConfig(max_batch_size=4, **settings)
    assert config.toy_capped_max_draft == 2 and config.drafters["toy_capped"].max_draft == 2
    bad = CliRunner().invoke(main, ["triton-repo", tiny_bundle, "--out", str(out), "--toy-capped-max-draft", "99"])
    assert bad.exit_code == 2 and "toy_capped_max_draft=99" in bad.output, bad.output
    with pytest.raises(ValueError, match="toy_capped_max_draft=0"):
        EngineConfig(drafters={"toy_capped": {"max_draft": 0}})
    # `specbuild inspect`: the setting with its default and help, and the drafter's guarantee row
    r = CliRunner().invoke(main, ["inspect", tiny_bundle])
    assert r.exit_code == 0, r.output
    assert "toy_capped_max_draft" in r.output and "Most tokens a toy draft" in r.output
    assert "capped prompt lookup" in r.output
    # served with the value given: drafts of at most 2 tokens, greedy output the target's
    engine = Engine(tiny_bundle, config)
    assert "toy_capped" in engine.methods and engine.describe_guarantees()["methods"]["toy_capped"]["acceptance"] \
        == "toy: specbuild verify, capped prompt lookup"
    plain, capped = run(engine, "none"), run(engine, "toy_capped")
    assert [r["token_ids"] for r in capped] == [r["token_ids"] for r in plain]
    assert engine.speculator.proposers["toy_capped"].longest == 2
    # HTTP: /health's body names the setting's value
    assert OpenAIServer(engine, ServeConfig(port=0)).health()[1]["drafter_settings"]["toy_capped_max_draft"] == 2
