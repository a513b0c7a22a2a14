"""Placeholder ClientApp for the fedfields Flower App.

It registers no message handlers yet: the train/evaluate/query handlers that run
``fedfields.train`` on a SuperNode's local views arrive with the federation issue.
The object exists so that ``[tool.flwr.app.components]`` resolves and ``flwr build``
can bundle the app.
"""

from flwr.clientapp import ClientApp

app = ClientApp()
