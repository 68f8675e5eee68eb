"""Key partitioning: requests that differ in a cache key never reuse each other's KV from where the key applies, and
requests that agree do.

A prefix cache keys KV by more than tokens: by the adapter (LoRA) that computed it, by a tenant's cache salt, and
by the images a prompt embeds. KV computed under one key and served under another is wrong KV that no error
reports. So every case serves one request on an empty cache, then a second one, and judges what the second reused:

- **Never across keys.** The second request may reuse page `i` of the first only if both agree on every token up
  to the end of that page, on the LoRA (name and path), on the cache salt, and on every image placed before the
  end of that page (identifier, offset, length). Causal attention makes a page's KV depend on everything before it
  and nothing after, so the pages before an image may be shared and none from the image's page on.
- **Reuse where they agree** (the positive control): the second request reuses every page they agree on, up to the
  pages of the first prompt that were cached whole and short of the second prompt's last token, which is always
  computed. A cache that never reuses fails here rather than passing the first rule by doing nothing.
- **The pages reused are the first request's.**

Cases are the directed ones (`DIRECTED`) and generated ones drawn from a small vocabulary, so that a salt equal to
a LoRA's name or path, an image identifier equal to a salt, and the tags an engine might use to label its keys come
up. The same seed gives the same cases.

    kvcert partition MODULE:FACTORY [--cases N] [--seed S] [--json PATH]

`FACTORY()` returns a `Probe` (`conformance.backend`, with the `Keys` it is served under): `page` tokens per page, `fresh()` for an empty cache, `serve(tokens, keys)` for one
request, computed and freed as its engine's scheduler does it.
"""

from __future__ import annotations

import importlib
import random
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from kvcert.conformance.aliases import canonical
from kvcert.conformance.backend import KINDS, Image, Keys, Probe, Served

__all__ = [
    "DIRECTED",
    "spelled",
    "KINDS",
    "Case",
    "Failure",
    "Image",
    "Keys",
    "Probe",
    "Report",
    "Served",
    "agreed_pages",
    "cases",
    "judge",
    "load",
    "run",
]


@dataclass(frozen=True)
class Case:
    name: str
    tokens_a: tuple[int, ...]
    keys_a: Keys
    tokens_b: tuple[int, ...]
    keys_b: Keys


def agreed_pages(case: Case, page: int) -> int:
    """Leading pages of the second request the first one's KV may serve, and the positive control asks it to."""
    a, b = case.tokens_a, case.tokens_b
    common = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    bound = min(common // page, len(a) // page, (len(b) - 1) // page)
    if case.keys_a.lora != case.keys_b.lora or case.keys_a.salt != case.keys_b.salt:
        return 0
    differ = set(case.keys_a.images) ^ set(case.keys_b.images)
    if differ:
        bound = min(bound, min(im.offset for im in differ) // page)
    return max(bound, 0)


def judge(case: Case, first: Served, second: Served, page: int) -> list[str]:
    """What the second request's reuse got wrong, if anything (each line names the rule)."""
    want = agreed_pages(case, page)
    if second.hit_tokens % page:
        return [f"reused {second.hit_tokens} tokens, not whole pages of {page}"]
    got = second.hit_tokens // page
    out = []
    if got > want:
        out.append(f"ACROSS KEYS: reused {got} pages where the requests agree on {want}")
    elif got < want:
        out.append(f"POSITIVE CONTROL: reused {got} pages of the {want} the requests agree on")
    if second.pages[:got] != first.pages[:got]:
        out.append(f"reused pages {list(second.pages[:got])}, not the first request's {list(first.pages[:got])}")
    return out


# --------------------------------------------------------------------------- cases

PAGE_PROMPT = 4
"""Directed prompts are four pages and three tokens long (scaled to the probe's page)."""


def _directed(page: int) -> list[Case]:
    p = tuple(range(1000, 1000 + PAGE_PROMPT * page + 3))
    lora_a = ("adapter-a", "/adapters/a")
    img = lambda ident: (Image(ident, page, page),)  # noqa: E731  (the second page)
    rows: list[tuple[str, Keys, Keys]] = [
        ("the same prompt (positive control)", Keys(), Keys()),
        ("the same cache salt", Keys(salt="tenant-1"), Keys(salt="tenant-1")),
        ("the same LoRA", Keys(lora=lora_a), Keys(lora=lora_a)),
        ("the same image", Keys(images=img("img-1")), Keys(images=img("img-1"))),
        ("a cache salt against none", Keys(), Keys(salt="tenant-1")),
        ("another cache salt", Keys(salt="tenant-1"), Keys(salt="tenant-2")),
        ("a LoRA against none", Keys(), Keys(lora=lora_a)),
        ("another LoRA name", Keys(lora=lora_a), Keys(lora=("adapter-b", "/adapters/a"))),
        ("another LoRA path", Keys(lora=lora_a), Keys(lora=("adapter-a", "/adapters/b"))),
        ("another image (the page before it is shared)", Keys(images=img("img-1")), Keys(images=img("img-2"))),
        ("an image moved by a page", Keys(images=img("img-1")), Keys(images=(Image("img-1", 2 * page, page),))),
        ("a salt that spells a LoRA's name", Keys(lora=lora_a), Keys(salt="adapter-a")),
        ("a salt that spells an image", Keys(images=img("img-1")), Keys(salt="img-1", images=img("img-1"))),
    ]
    return [Case(name, p, ka, p, kb) for name, ka, kb in rows]


DIRECTED = _directed
"""`DIRECTED(page)`: the directed cases for a probe's page size."""

_WORDS = ("a", "b", "lora", "cache_salt", "mm", "a|b", "/a")
"""A small vocabulary: values collide across key dimensions, and some spell the tags an engine might use. Salts
come from the first six: what vLLM's API accepts (non-empty, no '/', '@', '\\' or NUL)."""


def _keys(rng: random.Random, page: int, length: int) -> Keys:
    lora = (rng.choice(_WORDS[:5]), rng.choice(_WORDS[4:])) if rng.random() < 0.5 else None
    salt = rng.choice(_WORDS[:6]) if rng.random() < 0.5 else None
    images: list[Image] = []
    at = rng.randrange(0, page)
    while rng.random() < 0.5 and at + page <= length:
        n = rng.randrange(1, page + 1)
        images.append(Image(rng.choice(_WORDS), at, n))
        at += n + rng.randrange(0, 2 * page)
    return Keys(lora, salt, tuple(images))


def _mutate(rng: random.Random, keys: Keys, page: int, length: int) -> Keys:
    """One key changed: the LoRA's name or path, the salt, or an image added, dropped, renamed or moved."""
    what = rng.randrange(5)
    if what == 0:
        name, path = keys.lora or ("a", "/a")
        return replace(keys, lora=None if keys.lora and rng.random() < 0.3 else (name + "x", path))
    if what == 1:
        return replace(keys, lora=((keys.lora or ("a", "/a"))[0], (keys.lora or ("a", "/a"))[1] + "x"))
    if what == 2:
        return replace(keys, salt=None if keys.salt and rng.random() < 0.3 else (keys.salt or "") + "x")
    if not keys.images:
        return replace(keys, images=(Image("a", rng.randrange(0, max(1, length - page)), page),))
    i = rng.randrange(len(keys.images))
    im = keys.images[i]
    if what == 3:
        new = replace(im, identifier=im.identifier + "x")
    else:
        nxt = keys.images[i + 1].offset if i + 1 < len(keys.images) else length
        if im.offset + im.length + 1 > nxt:
            return replace(keys, images=keys.images[:i] + keys.images[i + 1 :])
        new = replace(im, offset=im.offset + 1)
    return replace(keys, images=keys.images[:i] + (new,) + keys.images[i + 1 :])


def spelled(probe: Any) -> list[Case]:
    """Directed cases from the engine's own names for a LoRA adapter (`probe.spellings(lora)`, where the probe
    offers it): a request whose salt is that name, after one under the adapter, and the other way round. An engine
    that keys both by one string shares them."""
    spell = getattr(probe, "spellings", None)
    if spell is None:
        return []
    p = tuple(range(1000, 1000 + PAGE_PROMPT * probe.page + 3))
    lora = ("adapter-a", "/adapters/a")
    out = []
    for name in spell(lora):
        out.append(Case(f"a salt that spells the adapter's engine id {name!r}", p, Keys(lora=lora), p, Keys(salt=name)))
        out.append(Case(f"the adapter after a salt that spells its engine id {name!r}", p, Keys(salt=name), p, Keys(lora=lora)))
    return out


def cases(count: int, seed: int, page: int, probe: Any = None) -> list[Case]:
    """The directed cases (with `probe`, those its engine's own key names make: `spelled`), then `count` generated
    ones: two prompts sharing a prefix, under the same keys (a third of them) or keys one change apart."""
    rng = random.Random(seed)
    out = list(DIRECTED(page)) + spelled(probe)
    for k in range(count):
        length = rng.randrange(2, 7) * page + rng.randrange(0, page)
        a = tuple(rng.randrange(1, 50_000) for _ in range(length))
        b = (
            a
            if rng.random() < 0.7
            else a[: rng.randrange(1, length)] + tuple(rng.randrange(1, 50_000) for _ in range(page))
        )
        ka = _keys(rng, page, min(len(a), len(b)))
        kb = ka if rng.random() < 1 / 3 else _mutate(rng, ka, page, min(len(a), len(b)))
        out.append(Case(f"generated {k}", a, ka, b, kb))
    return out


# --------------------------------------------------------------------------- running


@dataclass(frozen=True)
class Failure:
    case: str
    why: tuple[str, ...]
    keys_a: Keys
    keys_b: Keys
    tokens: tuple[int, int]
    """The two prompts' lengths."""
    hit_tokens: int


@dataclass
class Report:
    target: str
    page: int
    cases: int = 0
    reused: int = 0
    """Cases where the second request reused anything (the positive controls ran)."""
    isolated: int = 0
    """Cases whose keys differ somewhere the second request could have reused (the partition was tested)."""
    failures: list[Failure] = field(default_factory=list)
    not_checked: dict[str, int] = field(default_factory=dict)
    """Key kinds the probe does not take, and how many cases used them (not run)."""

    @property
    def passed(self) -> bool:
        return not self.failures and self.reused > 0 and self.isolated > 0


def _kinds(keys: Keys) -> set[str]:
    return {k for k, used in (("lora", keys.lora), ("salt", keys.salt), ("images", keys.images)) if used}


def run(target: str, probe: Probe, all_cases: Sequence[Case]) -> Report:
    """Serve every case on a fresh cache and judge it (a case using a key kind the probe does not take is counted
    under `not_checked` instead)."""
    report = Report(target, probe.page)
    takes = getattr(probe, "kinds", KINDS)
    for case in all_cases:
        missing = (_kinds(case.keys_a) | _kinds(case.keys_b)) - takes
        if missing:
            for kind in missing:
                report.not_checked[kind] = report.not_checked.get(kind, 0) + 1
            continue
        probe.fresh()
        first = probe.serve(case.tokens_a, case.keys_a)
        second = probe.serve(case.tokens_b, case.keys_b)
        report.cases += 1
        report.reused += second.hit_tokens > 0
        untouched = replace(case, keys_b=case.keys_a)
        report.isolated += agreed_pages(case, probe.page) < agreed_pages(untouched, probe.page)
        wrong = judge(case, first, second, probe.page)
        if wrong:
            report.failures.append(
                Failure(
                    case.name,
                    tuple(wrong),
                    case.keys_a,
                    case.keys_b,
                    (len(case.tokens_a), len(case.tokens_b)),
                    second.hit_tokens,
                )
            )
    return report


def load(target: str) -> Probe:
    """`module:factory` imported and called: the probe it returns."""
    module, _, attr = canonical(target).partition(":")
    if not attr:
        raise ValueError(f"target must look like module:factory, got {target!r}")
    probe: Probe = getattr(importlib.import_module(module), attr)()
    return probe
