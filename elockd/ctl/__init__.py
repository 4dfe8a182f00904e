"""elockctl, a second program: the operator's command line over the client."""
