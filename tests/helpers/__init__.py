"""Helpers the tests share that need more than ctxpar (train.py, configs/, models/).

Importable as ``helpers.<module>`` because pytest.ini puts tests/ on the path
(``pythonpath``); what needs only ctxpar lives in ctxpar.testing.
"""
