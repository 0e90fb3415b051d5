"""What each ``imglora`` command does, one module each; ``cli`` parses and calls these. Commands are
the only code that reaches the families, through ``imglora.families.registry``."""
