"""The request lifecycle both front ends call: prepare (every check once), submit, the replies
that are not generations.
"""
