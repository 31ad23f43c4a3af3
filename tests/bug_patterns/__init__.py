"""The bug-pattern suite: the precision report on bugs from public issue trackers."""
