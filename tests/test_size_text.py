"""size_text: the sizes the start-up, the preflight and export print (free space, a checkpoint's bytes)."""

import pytest

from sfttrain.checkpoint_folder import size_text


@pytest.mark.parametrize("n, text", [(3_250_000, "3.25 MB"), (850_000_000, "850 MB"), (12_500_000_000, "12.5 GB"),
                                     (999_000_000_000, "999 GB"), (999_960_000_000, "1 TB"),
                                     (1_500_000_000_000, "1.5 TB"), (2_000_000_000_000_000, "2 PB")])
def test_sizes_print_as_people_write_them(n, text):
    """3 significant digits in the unit that keeps them under 1000, also where rounding reaches it."""
    assert size_text(n) == text
