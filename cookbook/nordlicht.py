"""The made-up company the cookbook's examples ask about: facts no model saw in training, so an answer is right only
if it came from the documents."""

DOCUMENTS = [
    "Nordlicht Robotics is a company founded in 2011 in the town of Tromsvik.",
    "The founder of Nordlicht Robotics is an engineer named Ingrid Haldorsen.",
    "Nordlicht Robotics builds underwater drones that inspect fish farms.",
    "The best-selling drone of Nordlicht Robotics is called the Selkie.",
    "The Selkie drone can dive to a depth of 300 metres.",
    "Nordlicht Robotics employs 140 people.",
    "The chief executive of Nordlicht Robotics since 2020 is Marius Lund.",
    "Nordlicht Robotics opened a second office in the city of Bergen in 2019.",
    "The company mascot of Nordlicht Robotics is a puffin named Pip.",
    "Nordlicht Robotics drones are painted bright orange so divers can see them.",
    "The Selkie drone runs for six hours on one battery charge.",
    "Nordlicht Robotics won the Coastal Innovation Prize in 2023.",
]

# One worked example of the answer format, which suits these small models better than long instructions.
EXAMPLE = "Context:\nThe Selkie drone is yellow.\n\nQuestion: What colour is the Selkie drone?\nAnswer: yellow\n\n"

QUESTIONS = [
    ("Who founded Nordlicht Robotics?", "Ingrid Haldorsen"),
    ("In which town was Nordlicht Robotics founded?", "Tromsvik"),
    ("What is the name of the best-selling drone?", "Selkie"),
    ("What is the name of the company mascot?", "Pip"),
    ("In which city did Nordlicht Robotics open a second office?", "Bergen"),
]
