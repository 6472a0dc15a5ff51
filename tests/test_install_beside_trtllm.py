"""specbuild installs beside TensorRT-LLM 1.2.1 (issue 53 row 1), checked without a GPU or an index.

TensorRT-LLM 1.2.1's requirements.txt (recorded in specbuild/data/trtllm_pins.json with where it
was read) pins `llguidance==0.7.29`; a specbuild that required `llguidance>=1.0` made pip refuse
the pair, or upgrade llguidance and break TensorRT-LLM's pin. The check: every package both
projects require (specbuild's core dependencies and its extras, markers evaluated for Linux on
this Python) must have a version both specifier sets accept. The grammar code's side of the
0.7 line (one EOS id, JSON layout) is tested against a tokenizer class shaped like 0.7.29's."""

from __future__ import annotations

import json
import os
import sys

import pytest
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.utils import canonicalize_name
from packaging.version import InvalidVersion, Version

import specbuild
from specbuild.sampling import constraint

tomllib = pytest.importorskip("tomllib")  # Python 3.11+; the check is the same on every Python

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PINS = os.path.join(os.path.dirname(specbuild.__file__), "data", "trtllm_pins.json")
LINUX = {"sys_platform": "linux", "platform_system": "Linux", "os_name": "posix"}


def _applies(req: Requirement, extra: str = "") -> bool:
    return req.marker is None or req.marker.evaluate({**LINUX, "extra": extra})


def specbuild_requirements() -> dict[str, list[tuple[str, SpecifierSet]]]:
    """name -> [(where, specifiers)] over pyproject's dependencies and every extra."""
    project = tomllib.load(open(os.path.join(ROOT, "pyproject.toml"), "rb"))["project"]
    groups = {"dependencies": project["dependencies"], **{f"[{k}]": v for k, v in
                                                          project["optional-dependencies"].items()}}
    out: dict[str, list] = {}
    for where, reqs in groups.items():
        for text in reqs:
            req = Requirement(text)
            if _applies(req, where.strip("[]")):
                out.setdefault(canonicalize_name(req.name), []).append((where, req.specifier))
    return out


def trtllm_requirements() -> tuple[str, dict[str, SpecifierSet]]:
    pins = json.load(open(PINS))
    out = {}
    for text in pins["requirements"]:
        req = Requirement(text)
        if _applies(req):
            out[canonicalize_name(req.name)] = req.specifier
    return pins["release"], out


def _candidates(*specs: SpecifierSet) -> list[Version]:
    """Versions at and next to every bound the specifier sets name: where two sets of ==, >=, <=,
    <, >, ~= bounds overlap at all, one of these lies in the overlap."""
    out = set()
    for spec in specs:
        for s in spec:
            try:
                v = Version(s.version.replace(".*", ""))
            except InvalidVersion:
                continue
            rel = list(v.release)
            out.add(v)
            for i in range(len(rel)):
                up = rel[:i] + [rel[i] + 1]
                out.add(Version(".".join(map(str, up))))
                if rel[i] > 0:
                    out.add(Version(".".join(map(str, rel[:i] + [rel[i] - 1] + [999]))))
            out.add(Version(".".join(map(str, rel + [1]))))
    return sorted(out)


def overlap(a: SpecifierSet, b: SpecifierSet) -> Version | None:
    """A version both accept (pre-releases allowed: TensorRT-LLM bounds torch by an alpha), or None."""
    for v in _candidates(a, b):
        if a.contains(v, prereleases=True) and b.contains(v, prereleases=True):
            return v
    return None


def test_overlap_finds_and_refuses():
    assert overlap(SpecifierSet(">=1.0"), SpecifierSet("==0.7.29")) is None
    assert overlap(SpecifierSet(">=0.7.29"), SpecifierSet("==0.7.29")) == Version("0.7.29")
    assert overlap(SpecifierSet(">=2.4"), SpecifierSet(">=2.9.1,<=2.10.0a0")) is not None
    assert overlap(SpecifierSet(">=1.24"), SpecifierSet("<2")) is not None
    assert overlap(SpecifierSet(">=3"), SpecifierSet("==3.5.1")) == Version("3.5.1")
    assert overlap(SpecifierSet(">=0.122"), SpecifierSet(">=0.120.1,<=0.121.3")) is None


def test_specbuild_resolves_beside_tensorrt_llm_1_2_1():
    release, theirs = trtllm_requirements()
    assert release == "1.2.1" and str(theirs["llguidance"]) == "==0.7.29"
    ours = specbuild_requirements()
    shared = sorted(set(ours) & set(theirs))
    assert {"llguidance", "torch", "numpy", "fastapi", "pydantic"} <= set(shared), shared
    conflicts = [f"{name}: specbuild {where} wants {spec or 'any'}, tensorrt-llm {release} pins {theirs[name]}"
                 for name in shared for where, spec in ours[name] if overlap(spec, theirs[name]) is None]
    assert not conflicts, "\n".join(conflicts)


# ---- the grammar engine on the 0.7 line ------------------------------------------------------------
class Tokenizer07:
    """LLTokenizer as llguidance 0.7.29's _lib.pyi declares it: eos_token is one optional id."""

    def __init__(self, tokenizer, n_vocab=None, eos_token=None, slices=None):
        if eos_token is not None and not isinstance(eos_token, int):
            raise TypeError("argument 'eos_token': 'list' object cannot be interpreted as an integer")
        self.eos_token = eos_token


class Tokenizer1x(Tokenizer07):
    def __init__(self, tokenizer, n_vocab=None, eos_token=None, slices=None):
        self.eos_token = eos_token


def test_tokenizer_and_json_layout_by_release():
    import types

    old, new = types.SimpleNamespace(LLTokenizer=Tokenizer07), types.SimpleNamespace(LLTokenizer=Tokenizer1x)
    assert constraint.make_tokenizer(old, "{}", 10, [2, 7]).eos_token == 2
    assert constraint.make_tokenizer(old, "{}", 10, []).eos_token is None
    assert constraint.make_tokenizer(new, "{}", 10, [2, 7]).eos_token == [2, 7]
    assert constraint.make_tokenizer(new, "{}", 10, [2]).eos_token == 2
    assert constraint.json_options((0, 7, 29)) == constraint.FIXED_LAYOUT
    assert constraint.json_options((1, 9, 1)) == constraint.json_options(None) == {
        "whitespace_pattern": constraint.WHITESPACE}


@pytest.mark.skipif(sys.platform != "linux", reason="the llguidance wheel recorded is for Linux")
def test_installed_llguidance_is_accepted():
    """The llguidance this environment has satisfies the requirement pyproject now states."""
    llg = constraint.llguidance_release()
    if llg is None:
        pytest.skip("llguidance is not installed")
    (where, spec), *_ = specbuild_requirements()["llguidance"]
    assert spec.contains(".".join(map(str, llg))), (spec, llg)
