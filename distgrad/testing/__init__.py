"""Test equipment for distgrad's own suite; nothing in the library imports it.

:mod:`distgrad.testing.accel` is ``dgtest``, a test accelerator (a PrivateUse1
backend built on first use) with a stream-order checker, so that device code paths
(device maps, streams, events, ``Future(devices=...)``) are tested on machines
without a GPU.
"""
