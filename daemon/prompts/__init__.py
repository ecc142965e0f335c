"""Messages, tools and constraints into text the model reads: chat templates and the tool-call
syntaxes.
"""
