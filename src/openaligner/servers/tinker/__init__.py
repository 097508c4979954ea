"""The Tinker training API served on local models (``openaligner serve-tinker``).

``service`` holds what the calls do, ``futures`` the jobs behind the SDK's futures, ``sampling``
the ``asample`` path through the rollout engine, ``wire`` the protobuf bodies and ``app`` the
HTTP routes. Design notes: docs/tinker.md.
"""
