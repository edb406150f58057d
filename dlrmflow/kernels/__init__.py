"""Fused CPU kernels and Triton GPU kernels: embedding bags, optimizers, interaction, codecs."""
