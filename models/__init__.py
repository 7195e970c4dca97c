"""Reusable models built from warpnn layers (installed as ``warpnn_models``)."""
