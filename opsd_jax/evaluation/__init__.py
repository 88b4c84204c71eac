"""Scoring a model: answer extraction, evaluation runs and their results, the K_gen diagnostic."""
