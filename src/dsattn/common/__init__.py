"""Numerics shared by every operator family: checks, layouts, masks, softmax/LSE."""
