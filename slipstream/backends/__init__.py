"""Backends: the implementations that serve attention, linear layers, the fused decode stack and
MoE experts on one kind of device. Model files never name one."""
