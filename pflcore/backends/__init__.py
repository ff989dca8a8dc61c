"""One adapter per implementation of the ops (DESIGN.md §8): native (C++/OpenMP), cuda,
triton, reference (pure torch) and nets (the torch nets, chosen by the model's type). Each is
a class whose methods are the ops it serves, with one signature per op (``base.py``).
``pflcore.backend.select`` picks the adapter of a call. A new backend is one new adapter."""
