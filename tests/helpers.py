"""Test helpers shared across test files."""

import numpy as np


def assert_close(actual, expected, rtol=1e-5, atol=1e-6, err_msg=""):
    np.testing.assert_allclose(np.asarray(actual), np.asarray(expected), rtol=rtol, atol=atol, err_msg=err_msg)
