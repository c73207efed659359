"""What the user sees: the ancestor's plain lines, ``--json`` events, the summary and the live
view, each a subscriber of the event stream.

May import: the standard library, rich (the live view only), the vocabulary, ``jobs``,
``machines``, ``planner`` and ``results``.
"""
