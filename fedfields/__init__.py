"""Federated neural fields (NeRF, SIREN) on Flower, with privacy-leakage measurement."""
