"""accuracy_reward credits a final answer only (issue: restating the question earned full credit).

One table of completions a policy could write for arithmetic and math prompts, each with the reward it must
get: restated expressions and computations left undone score 0, so do intermediate results followed by a
wrong final answer; boxed, LaTeX, "the answer is", "= N", "#### N" and bare answers score 1 when right,
with math-verify's symbolic equivalences (fractions = decimals, negatives, closed forms).
"""

import pytest

from asyncgrpo_cli.rewards import accuracy_reward, shutdown_verification_pool
from asyncgrpo_cli.rewards.final_answer import extract_final_answer, is_final_value


@pytest.fixture(scope="module", autouse=True)
def _shutdown_pool_after_module():
    yield
    shutdown_verification_pool()


# (completion, ground truth, expected reward)
TABLE = [
    # restating the question, or a computation not followed by its value: no answer
    ("To compute 3 + 4, add them.", "7", 0.0),
    ("It is 12 - 5 for sure", "7", 0.0),
    ("3+4", "7", 0.0),
    ("We get 2*3+1", "7", 0.0),
    ("To calculate 775 * -986 * 840, multiply the results directly.", "-641886000", 0.0),
    ("To compute $3 + 4$, add them.", "7", 0.0),
    ("The answer is 3 + 4.", "7", 0.0),
    ("\\boxed{3+4}", "7", 0.0),
    ("$2^{10}$", "1024", 0.0),
    ("$x = 3 + 4$", "7", 0.0),
    ("We have 3 + 4 = 7, then 7 - 1", "6", 0.0),
    ("To calculate 8 * -1, we need to reverse the operation.", "-8", 0.0),  # a product, not a signed number
    ("To calculate the square root of -(-8 / 2), we need to invert it.", "4", 0.0),  # 8/2 still needs computing
    ("To find -(7 / 1), we convert the fraction.", "-7", 0.0),
    # intermediate results followed by a wrong (or no) final answer: the last answer counts
    ("3 + 4 = 7, and 7 * 2 = 14.", "7", 0.0),
    ("First 6 * 7 = 42. So the final answer is 41.", "42", 0.0),
    ("It is 7, not 8.", "7", 0.0),
    ("The answer is \\boxed{41}.", "42", 0.0),
    ("3 + 4 = 8", "7", 0.0),
    ("The answer is 8", "7", 0.0),
    ("I am not sure.", "7", 0.0),
    ("3 is already 1 / 1. There's no remainder to divide by 1, so 3 / ", "3", 0.0),  # cut off mid-expression
    # a hedged answer (alternatives offered) earns nothing, whichever alternative is right
    ("The answer is 7 or 8.", "7", 0.0),
    ("The answer is 7 or 8.", "8", 0.0),
    ("7 or 8", "7", 0.0),
    ("7 or 8", "8", 0.0),
    ("either 7 or 8", "7", 0.0),
    ("Either 7 or 8.", "8", 0.0),
    ("7/8", "7", 0.0),  # the fraction seven eighths
    ("7, 8 or 9", "7", 0.0),
    ("7, 8 or 9", "9", 0.0),
    ("The answer is 7 (or maybe 8).", "7", 0.0),
    ("The answer is **7** or **8**.", "7", 0.0),
    ("$7$ or $8$", "7", 0.0),
    # final answers
    ("3 + 4 = 7", "7", 1.0),
    ("It is 12 - 5 = 7 for sure", "7", 1.0),
    ("775 * -986 * 840 = -641886000", "-641886000", 1.0),
    ("#### 7", "7", 1.0),
    ("The answer is 7.", "7", 1.0),
    ("3 + 4 makes 7. The answer is 7", "7", 1.0),
    ("7", "7", 1.0),
    ("**7**", "7", 1.0),
    ("The answer is **-12**.", "-12", 1.0),
    ("\\boxed{7}", "7", 1.0),
    ("3 + 4 = 7, so 7 * 2 = 14. The answer is \\boxed{14}.", "14", 1.0),
    ("$3 + 4 = 7$", "7", 1.0),
    ("The answer is 8. Wait, no: the answer is 7.", "7", 1.0),  # corrected, not hedged
    ("We could take 3 or 4 apples, so 3 + 4 = 7", "7", 1.0),  # alternatives earlier, a single final answer
    ("The answer is 1/2 or 0.5", "0.5", 1.0),  # the same value twice
    ("7/8", "7/8", 1.0),
    # negative numbers, fractions = decimals, closed forms
    ("The answer is -7.", "-7", 1.0),
    ("#### -12", "-12", 1.0),
    ("$\\frac{1}{2}$", "0.5", 1.0),
    ("The answer is 0.5", "\\frac{1}{2}", 1.0),
    ("The answer is 1/2", "0.5", 1.0),
    ("The answer is $-\\frac{3}{4}$", "-0.75", 1.0),
    ("\\boxed{1+\\sqrt{2}}", "$1+\\sqrt{2}$", 1.0),
    ("Final Answer: The final answer is $\\frac{\\pi}{2}$. I hope it is correct.", "$\\pi/2$", 1.0),
]


def test_table_of_completions():
    assert len(TABLE) >= 25
    completions = [[{"role": "assistant", "content": text}] for text, _, _ in TABLE]
    rewards = accuracy_reward(completions=completions, solution=[gold for _, gold, _ in TABLE])
    wrong = [(text, gold, want, got) for (text, gold, want), got in zip(TABLE, rewards) if got != want]
    assert not wrong, "\n".join(f"{t!r} (truth {g!r}): expected {w}, got {r}" for t, g, w, r in wrong)


def test_offers_alternatives():
    from asyncgrpo_cli.rewards.final_answer import offers_alternatives

    hedged = ["The answer is 7 or 8.", "7 or 8", "either 7 or 8", "7, 8 or 9", "7, 8, or 9", "It is 7 or maybe 8",
              "The answer is 7, or possibly 8.", "The answer is 7 or 8, I think 7.", "The answer is -7 or -8"]
    plain = ["The answer is 7.", "7/8", "It is 7, not 8.", "The answer is 8. Wait, no: the answer is 7.",
             "the answer is 1/2 or 0.5", "We could take 3 or 4 apples, so 3 + 4 = 7", "7 or more", "3 + 4 = 7"]
    assert [t for t in hedged if not offers_alternatives(t)] == []
    assert [t for t in plain if offers_alternatives(t)] == []
    assert extract_final_answer("The answer is 7 or 8.") == []  # math-verify alone would answer 7


def test_issue_examples_score_zero():
    completions = [[{"role": "assistant", "content": "To compute 3 + 4, add them."}], "It is 12 - 5 for sure",
                   "3+4", "We get 2*3+1", "To calculate 775 * -986 * 840, multiply the results directly."]
    solution = ["7", "7", "7", "7", "-641886000"]
    assert accuracy_reward(completions=completions, solution=solution) == [0.0] * 5


def test_is_final_value_on_parsed_forms():
    import sympy

    three_plus_four = sympy.Add(3, 4, evaluate=False)
    assert not is_final_value(three_plus_four)
    assert not is_final_value(sympy.Eq(sympy.Symbol("x"), three_plus_four, evaluate=False))
    assert is_final_value(sympy.Eq(three_plus_four, 7, evaluate=False))
    assert is_final_value(sympy.Integer(7)) and is_final_value(sympy.Rational(-3, 4))
    assert is_final_value(1 + sympy.sqrt(2)) and is_final_value(sympy.Symbol("x") ** 2 + 1)
    assert extract_final_answer("To compute 3 + 4, add them.") == []
    assert extract_final_answer("3 + 4 = 7") == [7]
    assert extract_final_answer("50%") != []  # a percentage is a number as written
