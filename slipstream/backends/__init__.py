"""Backends: what serves attention, linear layers, the fused decode stack and MoE experts on one
kind of device, chosen once at start-up (select.py). Model files never name one.

base.py is the interface, reference.py plain torch on any device (what every faster path is
tested against), cpu/ the native C kernels (its kernels/, build.py and abi.py are leaves that
layers may call directly), cuda/ the GPU. This file imports nothing, so that layers can reach
the kernels without importing the backends that bind them.
"""
