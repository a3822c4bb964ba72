"""Weights mapped once per process and lent to every session.

The host store, the device store, DLPack, the device-route probes, and ORT's prepacked
weights.
"""
