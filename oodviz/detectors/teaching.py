"""What a detector teaches: its formula, paper, what it reads and when it fails, declared in its own module.

Every detector class declares ``teaching = Teaching(...)`` next to its ``summary`` and ``paper``, so the
app's "what it does" panel, the report and the docs read the same words as the code they describe:

- ``formula``: the score in LaTeX (as the module docstring has it; **higher = more OOD**), its definitions
  after the score as clauses separated by a top-level ``,\\quad``;
- ``citation``: the paper, as "Authors, *Title*, Venue Year" (the class's ``paper`` is its link);
- ``reads``: what the detector reads (logits, features, labels, the head, the model) and what it fits;
- ``fails_when``: one line on when it is known to do badly.

:func:`describe` returns them with the class's other facts; :func:`formula_clauses` splits a formula into the
clauses a narrow panel shows one per line. A subclass declares its own (an inherited
``teaching`` would describe its parent), and ``tests/detectors/test_teaching.py`` checks every registered detector.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class Teaching:
    formula: str
    citation: str
    reads: str
    fails_when: str

    def __post_init__(self):
        for key, value in asdict(self).items():
            if not isinstance(value, str) or not value.strip():
                raise ValueError(f"Teaching.{key} must be a non-empty string")
        if "\n" in self.fails_when:
            raise ValueError("Teaching.fails_when is one line")


def teaching_of(cls, name: str) -> dict:
    """``{"summary", "formula", "citation", "reads", "fails_when", "paper" (link), "inputs", "needs_fit",
    "needs_labels", "needs_head", "needs_model"}`` of detector class ``cls`` (registered as ``name``):
    its ``teaching`` and what the class declares. ValueError when the class declares no :class:`Teaching`."""
    teaching = vars(cls).get("teaching")
    if not isinstance(teaching, Teaching):
        raise ValueError(
            f"detector {name!r} ({cls.__module__}.{cls.__name__}) declares no teaching = Teaching(formula=..., "
            "citation=..., reads=..., fails_when=...) (oodviz.detectors.teaching)"
        )
    return {
        "summary": cls.summary,
        **asdict(teaching),
        "paper": cls.paper,
        "inputs": list(cls.inputs),
        "needs_fit": cls.needs_fit,
        "needs_labels": cls.needs_labels,
        "needs_head": cls.needs_head,
        "needs_model": cls.needs_model,
    }


CLAUSE_SEPARATOR = r",\quad"


def formula_clauses(formula: str) -> list[str]:
    r"""``formula`` split at its top-level :data:`CLAUSE_SEPARATOR` (``s(x) = ...,\quad T = ...`` -> ``["s(x) = ...",
    "T = ..."]``), each clause stripped; one clause for a formula without definitions. A separator inside braces
    (``{...}``) belongs to a sub-formula and stays."""
    clauses, depth, start, i = [], 0, 0, 0
    while i < len(formula):
        if formula.startswith(("\\{", "\\}"), i):  # escaped braces: literal set braces, not groups
            i += 2
            continue
        depth += {"{": 1, "}": -1}.get(formula[i], 0)
        if depth == 0 and formula.startswith(CLAUSE_SEPARATOR, i):
            clauses.append(formula[start:i].strip())
            i = start = i + len(CLAUSE_SEPARATOR)
            continue
        i += 1
    return [*clauses, formula[start:].strip()]
