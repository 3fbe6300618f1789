"""Seed material for the chat training prompts (prompts.py), written for this project.

Templates and word lists only: prompts.py combines them with documents found on this machine
(docstrings, package READMEs, man pages, message catalogs) and with random numbers. Nothing
here is taken from an evaluation set; prompts.py checks the result against Spec-Bench anyway.
A template's {slots} are filled from the list of the same name.
"""

from __future__ import annotations

TOPIC = [
    "the ocean at night", "a small mountain village", "the first day of spring", "an old lighthouse",
    "a busy train station", "friendship", "losing a game", "a rainy afternoon", "learning to ride a bike",
    "a forgotten library", "city lights", "a desert road trip", "the smell of fresh bread", "autumn leaves",
    "a robot that learns to paint", "a cat who hates Mondays", "moving to a new country", "a winter storm",
    "the last bus home", "a garden in summer", "a chess tournament", "space exploration", "a lost wallet",
    "a family dinner", "the sound of rain", "a childhood memory", "an abandoned amusement park",
    "a detective in a small town", "a dragon who is afraid of fire", "the future of cities", "a quiet morning",
    "climbing a volcano", "a street musician", "a ship in a storm", "the night sky", "a music festival",
    "starting a new job", "a broken clock", "a letter from the past", "a talking tree", "the end of a long war",
    "a bakery that opens at midnight", "the perfect sandwich", "a marathon", "an island without internet",
]

FORM = [
    "poem", "short story", "haiku", "limerick", "blog post", "diary entry", "song chorus", "fairy tale",
    "news report", "product review", "speech", "opening paragraph for a novel", "dialogue between two friends",
    "motivational message", "children's story",
]

WRITING = [
    "Write a {form} about {topic}.",
    "Compose a {form} about {topic}. Keep it under 150 words.",
    "Can you write a funny {form} about {topic}?",
    "Write a sad {form} about {topic}.",
    "I need a {form} about {topic} for my class. Please write one.",
    "Write an email to {person} about {situation}.",
    "Draft a polite message to {person} explaining {situation}.",
    "Write a short speech for {event}.",
    "Write a product description for {product}.",
    "Write an advertisement for {product} aimed at {audience}.",
    "Give me five creative names for {business}.",
    "Write a cover letter for a job as {job}.",
    "Rewrite this sentence to sound more formal: \"{casual}\"",
    "Make this sentence more exciting: \"{casual}\"",
    "Write a tweet announcing {announcement}.",
    "Write a review of {place} from the point of view of {audience}.",
]

PERSON = ["my manager", "a landlord", "a teacher", "my neighbour", "a customer", "the school principal",
          "an old friend", "a hotel", "my team", "a professor", "the city council", "a new colleague"]
SITUATION = ["a delayed project", "a broken heater", "missing a meeting", "a schedule change", "a refund request",
             "a noisy party next door", "taking a week off", "a mistake in an invoice", "a new office policy",
             "a request for a letter of recommendation", "a lost package", "a change of address"]
EVENT = ["a wedding", "a retirement party", "a graduation ceremony", "the opening of a library",
         "a charity run", "a team's tenth anniversary", "a science fair", "a birthday dinner"]
PRODUCT = ["a solar-powered lamp", "a reusable water bottle", "noise-cancelling headphones", "a smart plant pot",
           "a folding bicycle", "a language-learning app", "a handmade wooden chess set", "an electric kettle",
           "a budgeting spreadsheet", "a waterproof backpack", "a board game about trains", "a vegan cookbook"]
AUDIENCE = ["students", "busy parents", "retired people", "software developers", "travellers", "gamers",
            "small business owners", "teenagers", "nurses", "gardeners"]
BUSINESS = ["a coffee shop", "a bicycle repair shop", "a pet-sitting service", "a bakery", "a bookshop",
            "a cleaning company", "a yoga studio", "a food truck", "a tutoring service", "a flower shop"]
JOB = ["a librarian", "a junior web developer", "a barista", "a lab technician", "a delivery driver",
       "a museum guide", "a data analyst", "a chef", "a gardener", "a customer support agent"]
CASUAL = ["hey, can u send me the file asap", "we gotta fix this thing before friday", "the meeting was kinda boring",
          "i think the plan is ok but not great", "thx for the help yesterday", "the food was good i guess",
          "we went to the park and it was fun", "sorry i'm late, traffic was bad"]
ANNOUNCEMENT = ["a new product launch", "a store opening", "a concert next week", "a free online course",
                "a charity bake sale", "the results of a photo contest"]
PLACE = ["a seaside hotel", "a ramen restaurant", "a city museum", "a mountain cabin", "a public swimming pool",
         "a train journey", "a night market", "a theme park"]

ROLEPLAY = [
    "Pretend you are {role}. {ask}",
    "You are {role}. A visitor asks you: \"{ask}\" How do you answer?",
    "Act as {role} and answer this: {ask}",
    "Imagine you are {role}. Describe your typical day.",
    "As {role}, give advice to someone who {trouble}.",
]
ROLE = ["a pirate captain", "a medieval knight", "a friendly robot", "a travel guide in Rome", "a chef in Paris",
        "a detective", "an astronaut on the Moon", "a wise old wizard", "a personal fitness coach",
        "a tour guide in a museum", "a time traveller from the year 3000", "a grumpy cat", "a sports commentator",
        "a kindergarten teacher", "a librarian", "a mountain guide"]
ASK = ["What is your favourite food?", "What scares you the most?", "How do you spend your weekends?",
       "What would you change about the world?", "What advice would you give to a young person?",
       "What is the best thing about your job?", "Tell me about your greatest adventure.",
       "How do you deal with stress?"]
TROUBLE = ["cannot sleep", "is afraid of speaking in public", "wants to save money", "feels lonely",
           "has too much homework", "wants to learn to cook", "is starting a new job", "lost a friend"]

EXPLAIN = [
    "Explain {concept} in simple terms.",
    "What is {concept}?",
    "How does {concept} work?",
    "Explain {concept} to a ten-year-old.",
    "Why is {concept} important?",
    "Give a short introduction to {concept}.",
    "What are the main ideas behind {concept}?",
    "Describe {concept} and give an example.",
    "What are common misconceptions about {concept}?",
    "Compare {concept} and {concept2}.",
]
CONCEPT = [
    "photosynthesis", "gravity", "inflation", "the water cycle", "democracy", "the immune system",
    "machine learning", "black holes", "supply and demand", "evolution by natural selection", "compound interest",
    "climate change", "the Renaissance", "plate tectonics", "electric circuits", "the French Revolution",
    "vaccines", "blockchain", "the greenhouse effect", "DNA replication", "the stock market", "recycling",
    "the theory of relativity", "the Industrial Revolution", "antibiotics", "opportunity cost", "magnetism",
    "the scientific method", "renewable energy", "the Roman Empire", "probability", "nuclear fusion",
    "the printing press", "ocean tides", "human memory", "the nervous system", "encryption", "taxes",
    "volcanoes", "the Cold War", "sound waves", "chemical bonds", "globalization", "sleep",
    "the placebo effect", "friction", "social media", "the Silk Road", "cells", "the moon landing",
]

ADVICE = [
    "Give me three tips for {activity}.",
    "What are the pros and cons of {choice}?",
    "How can I get better at {activity}?",
    "I want to start {activity}. Where should I begin?",
    "List five common mistakes people make when {activity}.",
    "Should I choose {choice}? Help me decide.",
    "Make a one-week plan for {activity}.",
    "What do I need to know before {activity}?",
]
ACTIVITY = ["learning a new language", "running a marathon", "saving money", "studying for exams",
            "public speaking", "cooking at home", "growing vegetables", "writing a novel", "learning to code",
            "travelling on a budget", "taking better photos", "sleeping well", "working from home",
            "learning the guitar", "managing time", "meeting new people", "keeping a journal", "hiking"]
CHOICE = ["working from home", "buying an electric car", "living in a big city", "renting instead of buying",
          "studying abroad", "getting a dog", "freelancing", "learning two languages at once",
          "taking a gap year", "using a tablet instead of a laptop"]

REASONING = [
    "If all {a} are {b} and some {b} are {c}, can we say that some {a} are {c}? Explain.",
    "{n1} people shake hands with each other exactly once. How many handshakes are there?",
    "A is taller than B, and B is taller than C. Who is the shortest? Explain your reasoning.",
    "I have {n1} socks in a drawer, half red and half blue. How many must I take out in the dark to be sure of a pair?",
    "A farmer has {n1} sheep and all but {n2} run away. How many are left?",
    "Which is heavier, a kilogram of feathers or a kilogram of steel? Why?",
    "If today is {day}, what day will it be in {n1} days?",
    "Tom is older than Anna. Anna is older than Ben. Is Ben older than Tom? Explain.",
    "There are {n1} birds on a wire. A hunter shoots {n2}. How many remain on the wire?",
    "A clock shows {hour} o'clock. What is the angle between the hour and the minute hand?",
]
A = ["cats", "teachers", "cars", "apples", "painters"]
B = ["animals", "people", "machines", "fruits", "artists"]
C = ["pets", "musicians", "red things", "sweet things", "writers"]
DAY = ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday"]
HOUR = ["3", "6", "9", "2", "4", "10"]

GENERAL_QA = [
    "What is the capital of {country}?",
    "What language is spoken in {country}?",
    "Where is {country}?",
    "What currency is used in {country}?",
    "Tell me three facts about {country}.",
    "What is {country} famous for?",
    "What is the weather like in {country}?",
    "Which countries border {country}?",
    "Where is {language} spoken?",
    "How many people speak {language}?",
    "Who invented {invention}?",
    "When was {invention} invented?",
    "How does {invention} work?",
    "What is the tallest {landmark_kind} in the world?",
    "Why is the sky blue?",
    "How many legs does {animal} have?",
    "What does {animal} eat?",
    "Where does {animal} live?",
    "How long does {animal} live?",
]
INVENTION = ["the telephone", "the light bulb", "the airplane", "the radio", "the bicycle", "the computer",
             "the printing press", "the steam engine", "the microscope", "paper", "the compass", "television",
             "the World Wide Web", "the refrigerator", "the camera"]
LANDMARK_KIND = ["mountain", "building", "waterfall", "tree", "bridge", "tower"]
ANIMAL = ["a spider", "an octopus", "a giraffe", "a penguin", "a kangaroo", "a honeybee", "a dolphin",
          "an elephant", "a snail", "a crocodile", "an owl", "a tortoise", "a hedgehog", "a koala"]

CODE = [
    "Write a {lang} function that {task}.",
    "Write a {lang} program that {task}.",
    "How do I write code in {lang} that {task}?",
    "Implement a function in {lang} that {task}. Add comments.",
    "Show me an example in {lang} of a function that {task}, with a short explanation.",
]
LANG = ["Python", "Python", "Python", "JavaScript", "C++", "Java", "C", "Rust", "Go", "TypeScript", "Bash", "C#"]
TASK = [
    "reverses a string", "checks whether a number is prime", "computes the factorial of n",
    "returns the n-th Fibonacci number", "sorts a list with bubble sort", "finds the largest element of a list",
    "counts the vowels in a string", "checks whether a word is a palindrome", "merges two sorted lists",
    "removes duplicates from a list", "computes the greatest common divisor of two numbers",
    "converts Celsius to Fahrenheit", "reads a text file and counts its words", "implements binary search",
    "finds the second largest number in an array", "flattens a nested list", "checks balanced parentheses",
    "computes the sum of the digits of a number", "transposes a matrix", "generates all permutations of a string",
    "implements a stack with push and pop", "implements a queue using two stacks", "counts word frequencies",
    "validates an email address", "converts a number to binary", "finds the longest common prefix of strings",
    "rotates an array by k positions", "computes the median of a list", "checks whether two strings are anagrams",
    "implements quicksort", "finds all prime numbers below n", "multiplies two matrices",
    "parses a CSV line into fields", "computes the power set of a set", "detects a cycle in a linked list",
    "reverses a linked list", "computes the depth of a binary tree", "implements a simple LRU cache",
    "finds the missing number in 1..n", "converts a Roman numeral to an integer", "prints a multiplication table",
    "checks whether a year is a leap year", "finds the intersection of two lists", "capitalises each word",
    "computes the edit distance between two strings", "runs breadth-first search on a graph",
]
CODE_ON_SNIPPET = [
    "Explain what this {lang} code does:\n\n```{ext}\n{code}\n```",
    "Can you add comments to this code?\n\n```{ext}\n{code}\n```",
    "Is there a bug in this code? If so, how would you fix it?\n\n```{ext}\n{code}\n```",
    "Write a unit test for this function:\n\n```{ext}\n{code}\n```",
    "How could this code be made simpler or faster?\n\n```{ext}\n{code}\n```",
    "Summarize in one paragraph what the following function does.\n\n```{ext}\n{code}\n```",
]

SUMMARIZE = [
    "Summarize: {doc}",
    "Summarize the following text.\n\n{doc}",
    "Summarize this in three sentences:\n\n{doc}",
    "Write a short summary of the text below.\n\n{doc}",
    "{doc}\n\nSummarize the text above in a few sentences.",
    "TL;DR:\n\n{doc}",
    "Give the main points of this text as a bulleted list.\n\n{doc}",
    "Write a one-sentence summary: {doc}",
]
CONTEXT_QA = [
    "{doc}\n{question}",
    "{doc}\n\nQuestion: {question}\nAnswer:",
    "Read the text and answer the question.\n\n{doc}\n\nQuestion: {question}",
    "Use the passages below to answer the question.\n\n{doc}\n\n{question}",
    "Based on this text, {question_lc}\n\n{doc}",
]
DOC_QUESTIONS = [
    "What is {title}?", "What does {title} do?", "What is {title} used for?", "How do you use {title}?",
    "What are the main features of {title}?", "Who would use {title}, and why?",
    "What does the text say about {term}?", "What is the role of {term} in {title}?",
    "Which options or functions are mentioned?", "What problem does {title} solve?",
]
EXTRACTION = [
    "Extract all the names of functions, classes or commands mentioned in this text:\n\n{doc}",
    "List the key terms in the following text, one per line.\n\n{doc}",
    "From the text below, extract every number and what it refers to. Answer in JSON.\n\n{doc}",
    "Classify the following text as technical, legal, literary or other, and explain why.\n\n{doc}",
    "Turn the following text into a list of facts.\n\n{doc}",
]

TRANSLATE = [
    "Translate German to English: {src}",
    "Translate German to English: {src}",
    "Translate German to English: {src}",
    "Translate this German sentence into English: {src}",
    "What does this mean in English? \"{src}\"",
    "Translate {lang_name} to English: {src}",
    "Translate English to German: {en}",
    "Translate to {lang_name}: {en}",
]
LANG_NAMES = {"de": "German", "fr": "French", "es": "Spanish", "it": "Italian", "pt": "Portuguese",
              "nl": "Dutch", "sv": "Swedish", "pl": "Polish"}

# GSM8K-style word problems: {name}s, {item}s and numbers n1..n4 drawn per prompt
MATH = [
    "{name} buys {n1} {item} at ${n2} each and pays with a ${n4}00 bill. How much change does {name} get?",
    "{name} reads {n1} pages a day. How many pages does {name} read in {n2} weeks?",
    "A shop sold {n1} {item} on Monday and {n2} more on Tuesday than on Monday. How many {item} were sold in total?",
    "{name} has {n3} {item}. {name2} has {n1} fewer. How many {item} do they have together?",
    "A train travels at {n1}0 km per hour for {n2} hours. How far does it go?",
    "{name} earns ${n1} per hour and works {n2} hours a day, {n5} days a week. How much does {name} earn in a week?",
    "There are {n3} students in a class. {n6}% of them walk to school. How many students walk?",
    "{name} baked {n3} cookies and gave {n1} to each of {n5} friends. How many cookies are left?",
    "A rectangle is {n1} cm long and {n2} cm wide. What are its area and perimeter?",
    "{name} saves ${n1} every week. How many weeks until {name} has ${n4}00?",
    "A recipe needs {n5} eggs for {n2} people. How many eggs are needed for {n3} people?",
    "{name} runs {n1} km on weekdays and twice as far on each weekend day. How far does {name} run in a week?",
    "A book costs ${n3}. It is on sale for {n6}% off. What is the sale price?",
    "{name} is {n1} years old. {name2} is {n5} times as old. How old will {name2} be in {n2} years?",
    "A tank holds {n4}00 litres. It is filled at {n1} litres per minute. How long does it take to fill?",
    "{name} bought {n5} packs of {item} with {n1} in each pack and used {n2} of them. How many are left?",
    "The price of a bike went from ${n3}0 to ${n4}00. By what percentage did the price change?",
    "{name} has to read a {n4}00-page book in {n5} days. How many pages per day is that?",
    "A farm has {n1} cows and {n2} chickens. How many legs are there on the farm?",
    "{name} spends {n6}% of a ${n4}000 salary on rent. How much is left for everything else?",
    "Solve for x: {n1}x + {n2} = {n3}.",
    "What is {n3} times {n1}? Show your steps.",
    "What is the average of {n1}, {n2}, {n3} and {n5}?",
    "A pizza is cut into {n5} slices. {name} eats {n2} of them. What fraction of the pizza is left?",
]
NAME = ["Maria", "Ahmed", "Lena", "Kofi", "Yuki", "Carlos", "Priya", "Tom", "Sara", "Ivan", "Mei", "Omar",
        "Julia", "Noah", "Aisha", "Lucas", "Fatima", "Ben", "Hana", "Diego"]
ITEM = ["apples", "pencils", "notebooks", "stickers", "oranges", "marbles", "books", "cupcakes", "tickets",
        "toy cars", "candles", "bottles of juice", "flowers", "shirts", "baseball cards"]

# self-instruct: the target writes new tasks after a few of these (prompts.py)
SELF_INSTRUCT_HEAD = "Here are some tasks that people ask an AI assistant:\n{examples}\nWrite one new task that is different from these. Reply with the task only."

COUNTRY = ["France", "Japan", "Brazil", "Kenya", "Canada", "Norway", "Egypt", "India", "Mexico", "Australia",
           "Germany", "Peru", "Vietnam", "Morocco", "Sweden", "Argentina", "Nigeria", "Thailand", "Portugal", "Chile",
           "Iceland", "Greece", "Turkey", "Indonesia", "Poland", "Ghana", "New Zealand", "Ireland", "South Korea",
           "Colombia", "Finland", "Ethiopia", "Italy", "Spain", "Nepal", "Cuba", "Austria", "Mongolia", "Senegal"]
LANGUAGE = ["Spanish", "Swahili", "Portuguese", "Hindi", "Arabic", "Japanese", "Korean", "German", "French",
            "Russian", "Turkish", "Dutch", "Italian", "Polish", "Bengali", "Tamil", "Greek", "Finnish", "Hebrew",
            "Vietnamese", "Thai", "Basque", "Welsh", "Icelandic", "Zulu"]
