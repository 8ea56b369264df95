"""The checks `helm test` runs in the chart's test pods (helm/kvtune/templates/tests/).

Each module here is one standalone script on the standard library only: the chart carries a copy
(helm/kvtune/files/release-checks/, written with its other generated files) and a test pod runs it
as `python3 -c SCRIPT CHECK ...` in an image that has Python but not kvtune.
"""
