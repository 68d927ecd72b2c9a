"""Number formatting of the results tables."""

from lalte_jax.eval.report import format_value


def test_format_value_keeps_precision_visible():
  assert format_value(None) == "–"
  assert format_value(0.0) == "0.0"
  assert format_value(87.84) == "87.8"
  assert format_value(2.0) == "2.00"  # a loss of 2.0, not the integer 2
  assert format_value(0.1234) == "0.123"
  assert format_value(7) == "7"
