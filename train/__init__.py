"""Training scripts built on warpnn and the model zoo (installed as ``warpnn_train``)."""
