"""This app's ClientApp (`clients.client_app`) over its client halves (`clients.halves`)."""
