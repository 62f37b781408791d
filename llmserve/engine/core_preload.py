"""Imported once by the process engine cores fork from (core_client): torch, loaded there so that a core starts
without importing it again (a second and more on a CPU). OpenMP reads its thread count when torch loads it, so
torch is loaded with none, and each core sets the count its own environment asks for (core_bootstrap)."""

import os

os.environ.pop("OMP_NUM_THREADS", None)

import torch  # noqa: E402, F401  - what this module is for
