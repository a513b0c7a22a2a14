"""Flower strategies (message API) built on ``fedfields.aggregate``.

Empty for now: the strategies (FedAvg over global fields, learned federation weights,
meta-learning servers, ...) arrive with the federation issue.
"""
