"""Answer matching against hand-written cases."""
from adafuse.eval.metrics import exact_match, first_line_answer, lenient_match, normalize_answer


def test_normalize_removes_case_punctuation_articles_and_maps_number_words():
    assert normalize_answer("The  Beatles!") == "beatles"
    assert normalize_answer("Three Musketeers") == "3 musketeers"
    assert normalize_answer("an apple, a pear") == "apple pear"


def test_lenient_match_accepts_any_answer_inside_the_prediction():
    assert lenient_match("It was William Shakespeare.", ["Shakespeare", "Marlowe"])
    assert lenient_match("two", ["2"])
    assert not lenient_match("Shakespeares", ["Shakespeare"])
    assert not lenient_match("", ["Paris"])


def test_exact_match_is_strict_after_normalisation():
    assert exact_match("The Paris", ["paris"])
    assert not exact_match("Paris, France", ["Paris"])


def test_first_line_answer_cuts_at_blank_line_or_next_question():
    assert first_line_answer(" Paris\n\nQuestion: x") == "Paris"
    assert first_line_answer("Paris\nQuestion: next") == "Paris"
