"""What counts as a completion's final answer for ``accuracy_reward`` (SPEC §1.2, §10.2).

Extraction is math-verify's own (``math_verify.parse`` with the configs below); this module only chooses
those configs and rejects one kind of candidate that math-verify would evaluate:

* **Where the answer is looked for** (math-verify's priority tiers, the first tier with a match wins, and in
  a tier the rightmost match, i.e. the last answer written): a ``\\boxed{...}`` answer first
  (``boxed_match_priority=0``, as the reference trainer's ``accuracy_reward`` does); then an explicit final
  statement ("final answer is ...", "answer: ...", "the answer is 7", "answer ... = 7"); then, with
  ``try_extract_without_anchor=True`` on both configs, the last LaTeX or plain value in the text: a bare
  answer ("7", "**7**"), "= 7" ending a computation, "#### 7". Only that candidate counts: when math-verify
  cannot parse it (a completion cut off inside an expression), there is no answer. The reference trainer
  turns the anchor-free tier off (LaTeX only, anchored or boxed); the arithmetic recipes ask for "The answer
  is N" or a bare number, which that setting would never credit, so it stays on here and the next rule
  closes the hole it opens.
* **An expression that still needs computing is not an answer** (`is_final_value`): when the chosen candidate
  is an arithmetic expression of numbers whose value is a plain number ("3 + 4", "12 - 5", "2*3+1",
  "8 * -1", "8/2", "$2^{10}$", "$\\sqrt{4}$"), the completion restated the computation instead of doing it
  and has no answer (reward 0, even if an earlier line held the value: the last answer counts). Numbers
  written as numbers stay answers: integers, decimals, ``p/q`` in lowest terms and ``\\frac{p}{q}``,
  percentages, negatives; so do closed forms that do not reduce to a number (``1+\\sqrt{2}``, ``\\pi/2``)
  and symbolic answers (``x^2+1``). For an equation the value after its last ``=`` is checked ("$3+4=7$"
  answers 7, "$x = 3+4$" answers nothing).

* **A hedged answer is not an answer** (`offers_alternatives`): when the final answer is one of several
  different values offered as alternatives ("The answer is 7 or 8.", "either 7 or 8", "7, 8 or 9", "7 (or
  maybe 8)"), the completion has no answer, whichever alternative is right: a policy rewarded for listing
  candidates learns to list them. math-verify would take the first value after "the answer is" (7) and the
  last one of a bare list (8). Equal values stay an answer ("1/2 or 0.5"), and so does a corrected statement
  whose last answer stands alone ("The answer is 8. Wait, no: the answer is 7."). ``7/8`` is the fraction, not
  a hedge; in LaTeX, "$7$ or $8$" is parsed as a set and matches no single ground truth.
"""

from __future__ import annotations

import re
from fractions import Fraction
from typing import Any

__all__ = ["answer_extraction_config", "extract_final_answer", "is_final_value", "offers_alternatives"]


def answer_extraction_config() -> list[Any]:
    """math-verify extraction targets for a completion: LaTeX (boxed first) and plain expressions, both
    with their anchor-free tier on (see the module docstring).

    Raises:
        ImportError: math-verify is not installed.
    """
    from math_verify import ExprExtractionConfig, LatexExtractionConfig

    return [
        LatexExtractionConfig(boxed_match_priority=0, try_extract_without_anchor=True),
        ExprExtractionConfig(try_extract_without_anchor=True),
    ]


def is_final_value(value: Any) -> bool:
    """Whether a parsed answer (a sympy object from ``math_verify.parse``) states a value rather than a
    computation still to be done.

    False for a numeric expression (no free symbols, not a number as written) that ``doit()`` reduces to a
    plain number, e.g. ``Add(3, 4)`` or ``Pow(2, 10)``; for an equation or inequality, its right-hand side
    is checked; for a set or tuple, every element. True for everything else: numbers, fractions
    ``p/q`` in lowest terms (``Mul(p, Pow(q, -1))``, with an optional ``-1`` sign factor), percentages
    (``Mul(n, UnevaluatedExpr(1/100))``), irrational closed forms, symbolic expressions, matrices.
    """
    import sympy

    if isinstance(value, sympy.core.relational.Relational):
        return is_final_value(value.rhs)
    if isinstance(value, (sympy.FiniteSet, sympy.Tuple, tuple, list)):
        return all(is_final_value(v) for v in value)
    if not isinstance(value, sympy.Expr) or value.is_Number or value.free_symbols:
        return True
    if _written_number(value):
        return True
    try:
        reduced = value.doit()
    except Exception:  # noqa: BLE001 - cannot be evaluated: not a plain-number computation
        return True
    return not reduced.is_Number


def _written_number(value: Any) -> bool:
    """A number as a person writes one, which math-verify keeps unevaluated: a reduced fraction ``p/q``
    (``q > 1``, ``gcd(p, q) = 1``; ``8/2`` or ``7/1`` still needs computing) or a percentage ``n%``, each with an
    optional sign. ``8 * -1`` (``Mul(-1, 8)``) is a product, not a signed number."""
    import math

    import sympy

    if not isinstance(value, sympy.Mul):
        return False
    factors = list(value.args)
    rest = [f for f in factors if not f.is_Number]  # the one denominator or percent factor
    if len(rest) != 1:
        return False
    (other,) = rest
    percent = isinstance(other, sympy.UnevaluatedExpr) and other.args[0] == sympy.Rational(1, 100)
    fraction = isinstance(other, sympy.Pow) and other.base.is_Integer and other.exp == -1
    if not (percent or fraction):
        return False
    numbers = [f for f in factors if f.is_Number]
    if len(numbers) == 2 and sympy.S.NegativeOne in numbers:  # the sign of -p/q or -n%
        numbers.remove(sympy.S.NegativeOne)
    if len(numbers) != 1:
        return False
    if percent:
        return True
    p, q = numbers[0], other.base
    return p.is_Integer and int(q) > 1 and math.gcd(int(p), int(q)) == 1


_ANCHOR = re.compile(r"answer|\\boxed|####", re.IGNORECASE)
_NUMBER = re.compile(r"(?<![\w.])-?\d+(?:\.\d+)?(?:\s*/\s*\d+)?(?![\w.]*\d)")
_PUNCT = r"[\s*$%()\[\]{}=:]*"
# What may stand between two alternatives: "or" (with up to two words such as "maybe", "possibly" after it), or a
# comma inside a list that an "or" ends ("7, 8 or 9").
_OR_LINK = re.compile(rf"{_PUNCT},?{_PUNCT}(?:either\s+)?or(?:\s+[a-z]+){{0,2}}?{_PUNCT}", re.IGNORECASE)
_COMMA_LINK = re.compile(rf"{_PUNCT},{_PUNCT}")


def offers_alternatives(text: str) -> bool:
    """Whether the final answer of ``text`` is hedged: offered with different alternatives joined by "or".

    The final answer is the first number after the last "answer" / ``\\boxed`` / ``####`` when the text has
    one (math-verify's anchored tier), else the last number written. It is hedged when it belongs to a run of
    numbers linked by "or" (up to two words after it: "7 or maybe 8") or by commas in a list an "or" ends
    ("7, 8 or 9"), and the run holds at least two different values ("1/2 or 0.5" is one value).

    Args:
        text: the completion's text.

    Returns:
        True for "The answer is 7 or 8.", "either 7 or 8", "7, 8 or 9"; False for "The answer is 7.", "It is
        7, not 8.", "The answer is 8. Wait, no: the answer is 7.", "7/8" (a fraction).
    """
    anchors = list(_ANCHOR.finditer(text))
    start = anchors[-1].end() if anchors else 0
    numbers = list(_NUMBER.finditer(text, start))
    if len(numbers) < 2:
        return False
    chosen = 0 if anchors else len(numbers) - 1
    runs: list[list[int]] = [[0]]
    has_or = [False]
    for i in range(1, len(numbers)):
        between = text[numbers[i - 1].end():numbers[i].start()]
        if _OR_LINK.fullmatch(between):
            runs[-1].append(i)
            has_or[-1] = True
        elif _COMMA_LINK.fullmatch(between):
            runs[-1].append(i)
        else:
            runs.append([i])
            has_or.append(False)
    for run, linked in zip(runs, has_or):
        if linked and chosen in run:
            values = {_value(numbers[i].group()) for i in run}
            return len(values) > 1
    return False


def _value(number: str) -> Fraction | str:
    try:
        return Fraction(number.replace(" ", ""))
    except (ValueError, ZeroDivisionError):
        return number


def extract_final_answer(text: str) -> list[Any]:
    """The final answer of ``text`` as math-verify parses it, or ``[]`` when there is none.

    Runs ``math_verify.parse`` with `answer_extraction_config` and ``extraction_mode="first_match"``: only
    the chosen candidate counts, so a completion that ends in an expression math-verify cannot parse (one cut
    off mid-way, "so 3 / ") has no answer, rather than the number inside it. Markdown bold markers (``**``)
    become spaces first: math-verify's plain-expression pattern would read the closing ``**`` of ``**7**`` as
    an operator. No string fallback, and no timeout of its own (the caller bounds it: math-verify's timer
    needs the main thread). A candidate that fails `is_final_value` gives ``[]``, and so does a hedged answer
    (`offers_alternatives`).

    Returns:
        ``[sympy object]`` to pass to ``math_verify.verify``, or ``[]``.

    Raises:
        ImportError: math-verify is not installed.
    """
    from math_verify import parse

    parsed = parse(text.replace("**", " "), extraction_config=answer_extraction_config(),
                   extraction_mode="first_match", fallback_mode="no_fallback", parsing_timeout=None)
    if not parsed or not is_final_value(parsed[0]) or offers_alternatives(text):
        return []
    return parsed[:1]
